"""The megatron-core version gate, the CPU shim's scope, each upstream workaround against what it must do, the
package's install metadata, and that the docs the code cites exist."""

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_patch import compat
from megatron_patch.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_installed_megatron_core_is_a_tested_one():
    from packaging.specifiers import SpecifierSet

    assert compat.check_megatron_core_version() == importlib.metadata.version("megatron-core")
    assert importlib.metadata.version("megatron-core") in SpecifierSet(compat.TESTED_MEGATRON_CORE)


@pytest.mark.parametrize("version", ["0.16.1", "0.17.0", "0.19.0", "0.19.2"])
def test_every_release_in_the_tested_range_passes_the_gate(version):
    assert compat.check_megatron_core_version(version) == version


def test_missing_megatron_core_names_the_install_command(monkeypatch):
    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(compat.importlib.metadata, "version", version)
    with pytest.raises(compat.UnsupportedMegatronCore,
                       match=r"megatron-core is not installed.*pip install 'megatron-core>=0\.16\.1,<0\.20'"):
        compat.check_megatron_core_version()


@pytest.mark.parametrize("version", ["0.15.0", "0.16.0", "0.20.0", "1.0.0"])
def test_a_version_outside_the_range_names_the_range_in_one_line(version):
    with pytest.raises(compat.UnsupportedMegatronCore) as raised:
        compat.check_megatron_core_version(version)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"megatron-core {version} is installed, but megatron_patch is tested with "
                              "megatron-core>=0.16.1,<0.20 only")
    assert message.endswith("Fix: pip install 'megatron-core>=0.16.1,<0.20'")


def test_import_with_wrong_megatron_core_fails_clearly(tmp_path):
    # A dist-info earlier on sys.path is what importlib.metadata reports, as after `pip install megatron-core==0.15`.
    dist = tmp_path / "megatron_core-0.15.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.15.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    result = subprocess.run([sys.executable, "-c", "import megatron_patch"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "megatron-core 0.15.0 is installed, but megatron_patch is tested with megatron-core>=0.16.1,<0.20" \
        in result.stderr
    assert "pip install 'megatron-core>=0.16.1,<0.20'" in result.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """This checkout installed by pip into a new venv (no dependencies fetched: the venv sees this one's packages);
    returns the venv and its site-packages."""
    venv = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    site = subprocess.run([venv / "bin" / "python", "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the outer environment's packages (torch, megatron-core, ...) stand in for the dependencies
    outer = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "outer.pth").write_text("\n".join(outer) + "\n")
    # --ignore-installed: pip would otherwise uninstall this environment's own (editable) install first, and with
    # it the console scripts that later tests run.
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                    "--ignore-installed", "--prefix", str(venv), str(ROOT)], check=True, timeout=300,
                   env=dict(os.environ, PIP_NO_INPUT="1"))
    return venv, site


def test_package_installs_into_a_new_venv(installed):
    venv, site = installed
    script = venv / "bin" / "megatron-patch"
    assert script.exists(), "the megatron-patch console script is installed"
    # without PYTHONPATH, which may point at a checkout that would shadow the installed package
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    where = subprocess.run([venv / "bin" / "python", "-c", "import megatron_patch; print(megatron_patch.__file__)"],
                           cwd=venv.parent, env=env, check=True, capture_output=True, text=True, timeout=120).stdout
    assert where.startswith(site)
    help_text = subprocess.run([venv / "bin" / "python", script, "--help"], capture_output=True, text=True,
                               cwd=venv.parent, env=env, timeout=120, check=True).stdout
    assert "quickstart" in help_text


def test_installed_package_requires_the_tested_range_and_keeps_the_users_torch(installed):
    """pip installs megatron-core within the releases the shim was checked against and accepts any torch from
    megatron-core's own floor (a user's CUDA build is kept, not replaced), and this environment satisfies every
    requirement the package declares."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    _, site = installed
    [dist] = [d for d in importlib.metadata.distributions(path=[site]) if d.metadata["Name"] == "megatron_patch"]
    requirements = {r.name: r for r in map(Requirement, dist.requires) if r.marker is None}  # not the extras
    assert requirements["megatron-core"].specifier == SpecifierSet(compat.TESTED_MEGATRON_CORE)
    megatron_core_floor = Requirement(next(r for r in importlib.metadata.requires("megatron-core")
                                           if r.startswith("torch"))).specifier
    assert requirements["torch"].specifier == megatron_core_floor == SpecifierSet(">=2.6.0")
    assert dist.metadata["Requires-Python"] == ">=3.11,<3.14"
    unmet = {name: (str(r.specifier), importlib.metadata.version(name)) for name, r in requirements.items()
             if not r.specifier.contains(importlib.metadata.version(name), prereleases=True)}
    assert not unmet, unmet


def shim_scope(rank, world_size):
    import torch

    from megatron_patch.distributed import initialize_distributed

    initialize_distributed()
    import megatron.core.pipeline_parallel.schedules as schedules

    on_cpu = schedules.torch.zeros(1, device="cuda").device.type
    try:  # our code (and the user's) keeps the real torch: asking it for CUDA still fails loudly
        torch.zeros(1, device="cuda")
        real_torch_raises = False
    except (AssertionError, RuntimeError):
        real_torch_raises = True
    return on_cpu, real_torch_raises


def test_shim_applies_to_megatron_core_only():
    assert run_on_ranks(shim_scope, 1) == [("cpu", True)]


def test_shim_rewrites_fail_loudly_when_upstream_changes():
    import megatron.core.optimizer.clip_grads as clip_grads

    with pytest.raises(RuntimeError, match=re.escape("is no longer in megatron.core.optimizer.clip_grads")):
        compat._rewrite_function(clip_grads, "clip_grad_by_total_norm_fp32", [("text that is not there", "")])


_UPSTREAM = '''"""Stands in for a megatron-core module: what _rewrite_function rewrites, a few lines into its file."""


def total(values, device):
    result = 0
    for value in values:
        result += value
    if device == "cuda":
        raise RuntimeError("Torch not compiled with CUDA enabled")
    return result


class Optimizer(dict):
    def step(self, device):
        if device == "cuda":
            raise RuntimeError("Torch not compiled with CUDA enabled")
        return super().keys()
'''


def test_a_rewritten_function_raises_at_its_upstream_line(tmp_path, monkeypatch):
    """A traceback through a function compat rewrote names the line of the upstream file that raised, with its text
    (before, the function was compiled as a file of its own: its line 5 was reported as the file's line 5)."""
    import importlib.util
    import traceback

    path = tmp_path / "upstream_module.py"
    path.write_text(_UPSTREAM)
    spec = importlib.util.spec_from_file_location("upstream_module", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "upstream_module", module)
    spec.loader.exec_module(module)
    gpu_too = [('if device == "cuda":', 'if device in ("cuda", "gpu"):')]
    compat._rewrite_function(module, "total", gpu_too)
    compat._rewrite_function(module.Optimizer, "step", gpu_too)
    raising = [number for number, line in enumerate(_UPSTREAM.splitlines(), 1) if "raise RuntimeError" in line]
    for call, line in zip((lambda: module.total([1, 2], "gpu"), lambda: module.Optimizer().step("gpu")), raising):
        with pytest.raises(RuntimeError) as raised:
            call()  # "gpu" raises only in the rewritten function
        frame = traceback.extract_tb(raised.tb)[-1]
        assert (frame.filename, frame.lineno, frame.line) == (
            str(path), line, 'raise RuntimeError("Torch not compiled with CUDA enabled")')
    assert module.total([1, 2], "cpu") == 3 and list(module.Optimizer(a=1).step("cpu")) == ["a"]  # super() works


def test_a_rewrite_that_changes_the_line_count_is_refused():
    import megatron.core.optimizer.clip_grads as clip_grads

    with pytest.raises(ValueError, match="must keep its lines"):
        compat._rewrite_function(clip_grads, "clip_grad_by_total_norm_fp32",
                                 [("== 'torch.cuda.FloatTensor'", "== 'torch.cuda.FloatTensor'\n")])


def rewritten_megatron_core_lines(rank, world_size):
    """In a rank (the CPU shim applied): the upstream line each function compat rewrote starts at, and the line a
    traceback names when the line the MoE rewrite changed raises."""
    import linecache
    import traceback

    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import torch

    rewritten = [clip_grads.clip_grad_by_total_norm_fp32, optimizer.Float16OptimizerWithFloat16Params.__init__,
                 distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups,
                 distrib_optimizer.DistributedOptimizer.__init__, moe_utils.maybe_move_tensor_to_cpu]
    starts = []
    for function in rewritten:  # its first line, or its decorators' (as Python numbers a decorated function)
        code = function.__code__
        lines = [linecache.getline(code.co_filename, code.co_firstlineno + i).strip() for i in range(3)]
        starts.append(next(line for line in lines if not line.startswith("@")))

    class CudaUnknown(torch.Tensor):
        @property
        def is_cuda(self):
            raise RuntimeError("is_cuda asked")

    try:
        moe_utils.maybe_move_tensor_to_cpu(torch.zeros(2).as_subclass(CudaUnknown))
    except RuntimeError as error:
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.name == "maybe_move_tensor_to_cpu"]
        return starts, [(f.filename, f.line) for f in frames]
    return starts, []


def test_a_traceback_through_a_rewritten_megatron_core_function_names_its_upstream_line():
    import megatron.core.transformer.moe.moe_utils as moe_utils

    [(starts, frames)] = run_on_ranks(rewritten_megatron_core_lines, 1)
    names = ["clip_grad_by_total_norm_fp32", "__init__", "_build_model_and_main_param_groups", "__init__",
             "maybe_move_tensor_to_cpu"]
    assert [start.startswith(f"def {name}(") for start, name in zip(starts, names)] == [True] * len(names), starts
    # The line as megatron-core wrote it, which the rewrite changed (_moe_split_sizes_on_cpu).
    assert frames == [(moe_utils.__file__, "if torch.is_tensor(tensor) and tensor.is_cuda:")]


_WITH_CUDA = """
import sys
import torch

torch.cuda.is_available = lambda: True  # a GPU machine, as far as the shim can tell
real_cuda_method = torch.Tensor.cuda
from megatron_patch import compat

assert compat.apply_cpu_shim() is False
import megatron.core.tensor_parallel.utils as tp_utils

assert torch.Tensor.cuda is real_cuda_method
assert tp_utils.torch is torch, "megatron-core got the CPU view of torch"
assert not any(type(finder).__name__ == "_MegatronTorchView" for finder in sys.meta_path)
print("untouched")
"""


def test_shim_does_nothing_when_cuda_is_available():
    result = subprocess.run([sys.executable, "-c", _WITH_CUDA], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("untouched")


WRITER_QUEUE_USER = """
import sys, time
from megatron_patch import compat
compat.apply()
from megatron.core.dist_checkpointing.strategies import filesystem_async
getattr(filesystem_async, compat.write_results_queue_getter(filesystem_async))().put("ready")
print("ready", flush=True)
time.sleep(600)
"""


def test_the_checkpoint_writers_queue_server_dies_with_its_process():
    """A process killed after a torch_dist save leaves no Manager server behind (megatron-core spawns one)."""
    import psutil

    process = subprocess.Popen([sys.executable, "-c", WRITER_QUEUE_USER], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "the results queue is served by a process of its own"
    finally:
        process.kill()
        process.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        child.kill()
    assert not alive, [child.cmdline() for child in alive]


def free_megatron_core_groups(rank, world_size):
    import torch

    from megatron_patch.distributed import initialize_distributed

    initialize_distributed(tensor_model_parallel_size=world_size)
    c10d = torch.distributed.distributed_c10d
    built = len(c10d._world.pg_map)
    compat.destroy_model_parallel_and_free_groups()
    return built, list(c10d._world.pg_map) == [c10d._get_default_group()]


def rotary_model_dropped(rank, world_size):
    import gc
    import os
    import weakref

    import torch

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.testing import counting_batches

    initialize_distributed()
    threads = len(os.listdir("/proc/self/task"))  # gloo's communication threads are OS threads
    [model] = build_model_chunks(get_model_config("tiny-llama"), ParallelConfig(), 128)
    batch = next(counting_batches(torch.Generator().manual_seed(0), 2, 1))
    model(batch["tokens"], batch["position_ids"], None)
    rotary = weakref.ref(model.rotary_pos_emb)
    del model
    initialize_distributed()  # the next run in this process: the groups are destroyed and built again
    gc.collect()
    return rotary() is None, len(os.listdir("/proc/self/task")) - threads


def test_a_dropped_rotary_model_leaves_no_group_behind():
    """Failed before: megatron-core's lru_cache on RotaryEmbedding.forward kept the module of a model that had run
    a forward, and with it its context-parallel group, whose three gloo threads outlived the group's destruction."""
    [(freed, new_threads)] = run_on_ranks(rotary_model_dropped, 1)
    assert freed
    assert new_threads == 0


def _unreachable_cycle(finalised: list, name: str) -> None:
    class Node:
        def __del__(self):
            finalised.append(name)

    node = Node()
    node.self = node


def test_collections_in_the_block_free_its_garbage_only_and_return_the_rest_after():
    import gc

    finalised = []
    _unreachable_cycle(finalised, "before")
    with compat.collect_only_new_objects():
        _unreachable_cycle(finalised, "inside")
        gc.collect()  # what megatron-core's optimizer does at the end of its state
        assert finalised == ["inside"]
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert finalised == ["inside", "before"]


def test_merging_preprocess_partitions_collects_only_new_objects(tmp_path):
    """Failed before: megatron-core's add_index ends in a full gc.collect(), which walked every object of the process
    (0.13-0.2 s per merged file with torch and megatron-core imported); the merge's now walks only its own."""
    import gc

    from megatron_patch.data.preprocess import PreprocessConfig, preprocess

    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2 3"}\n' * 10)
    finalised = []
    enabled = gc.isenabled()
    gc.disable()  # no collection but the merge's own
    try:
        _unreachable_cycle(finalised, "before")
        preprocess(PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "out"),
                                    tokenizer_type="NullTokenizer", tokenizer_options={"vocab_size": 100}, workers=2,
                                    partitions=2))
        assert finalised == []
        gc.collect()
        assert finalised == ["before"]  # still collected by the process's own collections
    finally:
        if enabled:
            gc.enable()


def test_a_process_that_froze_objects_keeps_them_frozen():
    import gc

    kept = [object()]
    gc.freeze()
    try:
        with compat.collect_only_new_objects():
            pass
        # Frozen objects are in no generation. (Not their count: the harness's threads may free some meanwhile.)
        assert not any(obj is kept for obj in gc.get_objects())
    finally:
        gc.unfreeze()


def test_destroying_megatron_core_groups_frees_them():
    """Only the default group outlives megatron-core's: destroy_model_parallel alone leaves ~30 registered."""
    [(built, only_default_left)] = run_on_ranks(free_megatron_core_groups, 1)
    assert built > 1, "megatron-core built its groups"
    assert only_default_left


def distributed_optimizer_freed(rank, world_size):
    import gc
    import weakref

    import torch

    from megatron_patch.testing import SEQ, counting_batches, tiny_gpt_after_one_step
    from megatron_patch.training.step import lm_forward_step, train_step

    chunks, optimizer = tiny_gpt_after_one_step(distributed_optimizer=True)
    weights = [p.detach().clone() for p in chunks[0].parameters()]
    train_step(lm_forward_step, counting_batches(torch.Generator().manual_seed(1), 2, 1), chunks, optimizer, 1, SEQ, 2)
    stepped = all(not torch.equal(before, p) for before, p in zip(weights, chunks[0].parameters()))
    model = weakref.ref(chunks[0])
    del chunks, optimizer
    gc.collect()
    return stepped, model() is None


def test_a_dropped_model_with_the_distributed_optimizer_is_freed():
    """Failed before (megatron-core's optimizer as it is): its fp32 main parameters kept the model's autograd
    accumulators, and so DDP's hooks, out of the collector's reach, and the model, the optimizer and their process
    groups stayed in the process for good (a reused test worker gained ~50 threads per test). Detached, they go, and
    the Adam step still reaches every weight."""
    [(stepped, freed)] = run_on_ranks(distributed_optimizer_freed, 1)
    assert stepped
    assert freed


def moe_model_freed(rank, world_size, dispatcher):
    import gc
    import weakref

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.testing import SEQ, counting_batches
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    initialize_distributed(seed=1234)
    model_config, parallel = get_model_config("tiny-mixtral"), ParallelConfig(moe_token_dispatcher_type=dispatcher)
    [model], [as_upstream] = (build_model_chunks(model_config, parallel, 128) for _ in range(2))
    as_upstream.load_state_dict(model.state_dict())
    for layer in as_upstream.modules():
        if isinstance(layer, MoELayer):
            layer._forward_hooks.clear()  # megatron-core's layer as it is: its dispatcher keeps the history
    batch = next(counting_batches(torch.Generator().manual_seed(0), 2, 1))
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # as megatron-core's schedules set it for one microbatch
    for each in (model, as_upstream):
        each(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).sum().backward()
    same_gradients = all(ours.grad is not None and torch.equal(ours.grad, theirs.grad)
                         for ours, theirs in zip(model.parameters(), as_upstream.parameters()))
    chunks = wrap_model([model], DistributedDataParallelConfig())
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-3))
    train_step(lm_forward_step, counting_batches(torch.Generator().manual_seed(1), 2, 1), chunks, optimizer, 1, SEQ, 2)
    dropped = weakref.ref(model)
    del model, each, chunks, optimizer
    gc.collect()
    return same_gradients, dropped() is None


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_a_dropped_mixture_of_experts_model_is_freed(dispatcher):
    """Failed before: megatron-core's token dispatcher kept the last forward's routing probabilities with their
    autograd history, which held the router's gradient accumulator and DDP's hooks, so a trained MoE model stayed in
    the process for good. Detached after each forward, the model goes, with every gradient as megatron-core's own
    layer gives it."""
    [(same_gradients, freed)] = run_on_ranks(moe_model_freed, 1, (dispatcher,))
    assert same_gradients
    assert freed


def test_bert_lm_head_is_built_with_the_given_norm():
    """megatron-core's own choice without apex (WrappedTorchNorm) would refuse sequence parallelism here."""
    from megatron.core.models.bert import bert_lm_head
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patch.model.layers import TorchNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    config.sequence_parallel = True  # after validation, which wants TP > 1 for it
    imported = bert_lm_head.LNImpl
    with compat.bert_lm_head_norm(TorchNorm):
        head = bert_lm_head.BertLMHead(8, config)
    assert bert_lm_head.LNImpl is imported, "the module global is restored"
    assert head.layer_norm.weight.sequence_parallel, "TorchNorm marks its parameters for the TP all-reduce"


def test_interleaved_pipeline_on_gloo_matches_one_process():
    """PP=2 x VPP=2 gives the single-process loss and gradients; with megatron-core's default batch_p2p_comm it
    pairs the wrong messages (gradients off by a factor of ~300) and raises nothing."""
    from tests.model_oracles import loss_and_grads

    [reference] = run_on_ranks(loss_and_grads, 1, args=("tiny-gpt2", {}, [("single", {})]))
    interleaved = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    results = run_on_ranks(loss_and_grads, 2, args=("tiny-gpt2", {}, [("pp2xvpp2", interleaved)]), timeout=300)[0]
    (expected_loss, expected_grads), (loss, grads) = reference["single"], results["pp2xvpp2"]
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for key, expected in expected_grads.items():
        assert np.linalg.norm(grads[key] - expected) <= 1e-5 * np.linalg.norm(expected), key


def moe_patches(rank, world_size):
    """What megatron-core's MoE code meets on this machine, each fact the work of one patch."""
    import torch

    compat.apply()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    # _moe_router_without_te: the router's gating GEMM falls back to torch (NameError without the patch).
    inp = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(4, 8, requires_grad=True)
    logits = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    logits.sum().backward()
    gemm = (torch.allclose(logits, inp @ weight.T) and torch.allclose(inp.grad, weight.sum(0).expand(5, 8))
            and torch.allclose(weight.grad, inp.sum(0).expand(4, 8)))
    # _moe_split_sizes_on_cpu: the split sizes the dispatcher hands all_to_all_single are numpy, as gloo wants,
    # also in the name token_dispatcher.py imported.
    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    numpy_splits = isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
    # _CpuStream: the dispatcher's device-to-host stream as MoEAlltoAllTokenDispatcher.__init__ and
    # _maybe_dtoh_and_synchronize use it.
    cuda = token_dispatcher.torch.cuda
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        pass
    side.record_event().synchronize()
    one_stream = cuda.current_stream() == side
    return gemm, numpy_splits, one_stream


def test_moe_patches_are_in_place():
    """The MoE layers' three patches (docs/megatron-core-on-cpu.md, item 12); tests/test_model_layouts.py shows both
    dispatchers then give the single-process gradients."""
    assert run_on_ranks(moe_patches, 1) == [(True, True, True)]


def _rampup_batch(consumed, global_batch, rampup):
    """megatron-core 0.16.1's RampupBatchsizeNumMicroBatchesCalculator (num_microbatches_calculator.py):
    START plus INCR for every whole SAMPLES / ((GLOBAL - START) / INCR) samples consumed, GLOBAL after SAMPLES."""
    start, increment, samples = rampup
    if consumed > samples:
        return global_batch
    return start + int(consumed / (samples / ((global_batch - start) // increment))) * increment


@pytest.mark.parametrize("global_batch, rampup", [
    (16, (4, 4, 48)), (1024, (16, 8, 300000)), (16, (4, 4, 47)), (12, (2, 2, 7)), (6, (2, 2, 1)), (40, (1, 3, 100)),
])
def test_rampup_gives_each_iteration_the_batch_of_megatron_core_0_16(global_batch, rampup):
    """On 0.19.2 the ramp-up is a step schedule (megatron-core ignores rampup_batch_size there): it must give the
    batch 0.16.1's calculator gave after every number of consumed samples, including ramps of several steps per
    sample."""
    calculator = compat.rampup_calculator(global_batch, 1, 1, rampup, rank=-1)
    for consumed in range(min(rampup[2], 5000) + 3):
        calculator.update(consumed, consistency_check=False)
        assert calculator.get_current_global_batch_size() == _rampup_batch(consumed, global_batch, rampup), consumed


# A markdown file under the docs folder, optionally followed by ", item N" or "#N"; not part of a longer path or URL.
_DOC_CITATION = re.compile(r"(?<![\w./-])(docs/[\w./-]+?\.md)(?:#(\d+)|,? items? (\d+))?")
_SHARED_CITATION = re.compile(r"\bshared[/]")  # written so that this file does not cite it


def _repository_texts():
    """(path relative to the checkout, text) of every .py, .sh and .md file outside hidden and build folders."""
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders
                               if not d.startswith(".") and not d.endswith(".egg-info") and d not in ("build", "dist"))
        for name in sorted(files):
            if name.endswith((".py", ".sh", ".md")):
                path = Path(folder, name)
                yield path.relative_to(ROOT), path.read_text(errors="replace")


def test_every_cited_doc_and_item_exists():
    cited, missing = 0, []
    for relative, text in _repository_texts():
        for match in _DOC_CITATION.finditer(text):
            cited += 1
            doc, item = ROOT / match[1], match[2] or match[3]
            if not doc.is_file():
                missing.append(f"{relative}: {match[1]} does not exist")
            elif item and not re.search(rf"^## {item}\. ", doc.read_text(), re.MULTILINE):
                missing.append(f"{relative}: {match[1]} has no item {item}")
        if _SHARED_CITATION.search(text):
            missing.append(f"{relative} cites the workspace's shared folder, which a clone does not have")
    assert cited, "the code cites docs/ (compat.py does), so finding none means the pattern broke"
    assert not missing, "\n".join(missing)


def test_a_model_config_and_a_common_pt_load_bring_no_megatron_core_deprecation(tmp_path):
    """megatron-core warned "full scope is deprecated" at every TransformerConfig built with its own default
    CUDA-graph scope (0.16.1 and 0.19.2), and 0.19.2 logged "load_common is deprecated" at every read of a common.pt
    (0.16.1's saves and Megatron-LM's on it); failed before compat.cuda_graph_fields and the log filter."""
    import argparse
    import json
    import warnings

    import torch
    from megatron.core.dist_checkpointing import serialization

    from megatron_patch.model.builder import to_transformer_config
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.testing import logged_messages

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        to_transformer_config(get_model_config("tiny-llama"), ParallelConfig())
    assert not [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    torch.save({"args": argparse.Namespace(hidden_size=32)}, tmp_path / compat.COMMON_STATE_FILE)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    with logged_messages("megatron.core") as messages:
        assert serialization.load_common_state_dict(str(tmp_path))["args"].hidden_size == 32
    assert not [m for m in messages if "deprecat" in m.lower()], messages
