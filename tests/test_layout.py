"""The parallel layout is checked in one place (megatron_patch.layout.check_layout): each refusal names its flags,
and the launcher refuses a bad layout in its own process, in one line, before torchrun starts any rank.

    python -m pytest -q -p no:cacheprovider tests/test_layout.py
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.compat import transformer_engine_available
from megatron_patch.errors import UserError
from megatron_patch.layout import LayoutError, check_layout
from megatron_patch.model import get_model_config
from megatron_patch.model.parallel import ParallelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_RECIPE = os.path.join(ROOT, "examples", "gpt", "run_pretrain_gpt.sh")


def test_the_data_parallel_size_is_what_the_world_leaves():
    assert check_layout(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2) == 2
    assert check_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        virtual_pipeline_model_parallel_size=2, sequence_parallel=True, micro_batch_size=2,
                        global_batch_size=8, num_layers=8, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=256, seq_length=32, padded_vocab_size=128) == 2
    # Without a world only what does not depend on it is checked.
    assert check_layout(tensor_model_parallel_size=4, num_attention_heads=8, global_batch_size=6,
                        micro_batch_size=3) is None


@pytest.mark.parametrize("layout, message", [
    (dict(tensor_model_parallel_size=0), "--tensor-model-parallel-size must be at least 1, got 0"),
    (dict(pipeline_model_parallel_size=0), "--pipeline-model-parallel-size must be at least 1, got 0"),
    (dict(context_parallel_size=-1), "--context-parallel-size must be at least 1, got -1"),
    (dict(virtual_pipeline_model_parallel_size=0, pipeline_model_parallel_size=2),
     "--virtual-pipeline-model-parallel-size must be at least 1, got 0"),
    (dict(micro_batch_size=0), "--micro-batch-size must be at least 1, got 0"),
    (dict(global_batch_size=0, micro_batch_size=1), "--global-batch-size must be at least 1, got 0"),
    (dict(world_size=0), "world size 0 must be at least 1 (--nproc-per-node x NNODES)"),
    (dict(world_size=6, tensor_model_parallel_size=4),
     "world size 6 is not divisible by --tensor-model-parallel-size 4 x --pipeline-model-parallel-size 1 x "
     "--context-parallel-size 1 = 4; change the sizes or the number of processes"),
    (dict(tensor_model_parallel_size=8, num_attention_heads=12),
     "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8; choose a "
     "--tensor-model-parallel-size that divides it"),
    (dict(tensor_model_parallel_size=4, num_attention_heads=8, num_query_groups=2),
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (dict(tensor_model_parallel_size=4, ffn_hidden_size=3070), "--ffn-hidden-size 3070 is not divisible by "
                                                               "--tensor-model-parallel-size 4"),
    (dict(virtual_pipeline_model_parallel_size=2),
     "--virtual-pipeline-model-parallel-size (or --num-layers-per-virtual-pipeline-stage) needs "
     "--pipeline-model-parallel-size of at least 2, got 1"),
    (dict(pipeline_model_parallel_size=8, num_layers=12),
     "--num-layers 12 is not divisible by --pipeline-model-parallel-size 8; every model chunk needs the same number"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4, num_layers=12),
     "--num-layers 12 is not divisible by --pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size "
     "4 = 8 (the 6 layers of a pipeline stage are not divisible by --virtual-pipeline-model-parallel-size 4)"),
    (dict(pipeline_model_parallel_size=5, virtual_pipeline_model_parallel_size=2, num_layers=12),
     "--num-layers 12 is not divisible by --pipeline-model-parallel-size 5 x --virtual-pipeline-model-parallel-size "
     "2 = 10; every model chunk"),
    (dict(sequence_parallel=True), "--sequence-parallel needs --tensor-model-parallel-size greater than 1"),
    (dict(sequence_parallel=True, tensor_model_parallel_size=4, seq_length=1022),
     "--sequence-parallel needs --seq-length 1022 divisible by --tensor-model-parallel-size 4"),
    (dict(context_parallel_size=2, seq_length=1022), "--context-parallel-size 2 needs --seq-length 1022 divisible "
                                                     "by 2 x 2"),
    (dict(tensor_model_parallel_size=3, padded_vocab_size=128),
     "--tensor-model-parallel-size 3 does not divide the padded vocabulary 128 of the checkpoint to load"),
    (dict(micro_batch_size=4, global_batch_size=6),
     "--global-batch-size 6 is not divisible by --micro-batch-size 4; give a multiple of it"),
    (dict(world_size=8, micro_batch_size=2, global_batch_size=24),
     "--global-batch-size 24 is not divisible by --micro-batch-size 2 x data-parallel size 8 (world 8 / (TP 1 x PP 1 "
     "x CP 1)); give a multiple of 16"),
    # The expert grid of a mixture-of-experts model.
    (dict(expert_model_parallel_size=0), "--expert-model-parallel-size must be at least 1, got 0"),
    (dict(num_layers=2, num_moe_experts=6, expert_model_parallel_size=4),
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4; every expert-parallel rank holds as many "
     "experts as the others"),
    # TP x PP tiles 4 ranks, expert TP x EP x PP does not.
    (dict(world_size=4, pipeline_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2,
          num_moe_experts=4), "world size 4 is not divisible by --expert-tensor-parallel-size 2 x "
                              "--expert-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 8"),
    (dict(num_layers=2, expert_model_parallel_size=2),
     "--expert-model-parallel-size splits the experts of a mixture-of-experts model, and this model has none; add "
     "--num-experts or drop it"),
    (dict(num_layers=2, expert_tensor_parallel_size=2),
     "--expert-tensor-parallel-size splits the experts of a mixture-of-experts model, and this model has none"),
    (dict(num_moe_experts=4, moe_ffn_hidden_size=30, expert_tensor_parallel_size=4),
     "--moe-ffn-hidden-size 30 is not divisible by --expert-tensor-parallel-size 4"),
    (dict(tensor_model_parallel_size=2, num_moe_experts=4),
     "mixture-of-experts layers with --tensor-model-parallel-size greater than 1 need --sequence-parallel"),
])
def test_each_refusal_names_its_flags(layout, message):
    with pytest.raises(LayoutError) as error:
        check_layout(**layout)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    # The command-line tools print a UserError as one line; ValueError is what the model API raised before.
    assert isinstance(error.value, UserError) and isinstance(error.value, ValueError)


def test_the_layout_checks_come_in_a_fixed_order():
    """A layout wrong in several ways is refused for the first: the world before the model, the model before the
    batch (whose data-parallel size depends on a world that tiles)."""
    with pytest.raises(LayoutError, match="^world size 6"):
        check_layout(6, tensor_model_parallel_size=4, num_attention_heads=3, global_batch_size=5, micro_batch_size=2)
    with pytest.raises(LayoutError, match="^--num-attention-heads 3"):
        check_layout(8, tensor_model_parallel_size=4, num_attention_heads=3, global_batch_size=5, micro_batch_size=2)


@pytest.mark.parametrize("layout, message", [
    pytest.param(dict(moe_grouped_gemm=True), "--moe-grouped-gemm needs Transformer Engine's grouped GEMM",
                 marks=pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed")),
    (dict(moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type flex needs DeepEP or HybridEP on GPUs"),
    pytest.param(dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                      moe_token_dispatcher_type="alltoall"),
                 "--moe-token-dispatcher-type alltoall with expert tensor parallelism 2 needs NCCL",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL gathers unequal sizes")),
])
def test_moe_kernels_this_machine_lacks_are_refused(layout, message):
    with pytest.raises(ValueError) as error:
        ParallelConfig(**layout).validate(get_model_config("tiny-mixtral"), world_size=4)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_all_to_all_dispatcher_runs_on_gloo_with_expert_tp_1():
    """The way out the refusal above names: expert TP 1 under TP 2 (tests/test_model_layouts.py runs it)."""
    ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                   expert_tensor_parallel_size=1, moe_token_dispatcher_type="alltoall",
                   ).validate(get_model_config("tiny-mixtral"), world_size=4)


def test_the_torchrun_command_has_one_builder(monkeypatch):
    """The launcher's and `megatron-patch convert`'s torchrun commands come from torchrun_command: the same
    settings; the rapidformer launch follows NNODES/NODE_RANK/MASTER_ADDR, a local step stays on this host."""
    from torch.distributed.run import get_args_parser

    from megatron_patch.training.launcher import SHUTDOWN_SECONDS, torchrun_command, torchrun_settings

    for name, value in dict(NNODES="2", NODE_RANK="1", MASTER_ADDR="h", MASTER_PORT="6010").items():
        monkeypatch.setenv(name, value)
    for this_host_only, nodes, rank, address in ((False, "2", 1, "h"), (True, "1", 0, "127.0.0.1")):
        command = torchrun_command("some.module", ["--flag", "1"], 3, this_host_only=this_host_only)
        assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert all(setting in command for setting in torchrun_settings())
        launch = get_args_parser().parse_args(command[3:])
        assert launch.signals_to_handle == "SIGHUP,SIGQUIT"  # SIGTERM and Ctrl-C are the launcher's
        assert getattr(launch, "shutdown_timeout", SHUTDOWN_SECONDS) == SHUTDOWN_SECONDS  # torch 2.11 has no flag
        assert (launch.nproc_per_node, launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port) == (
            "3", nodes, rank, address, 6010)
        assert launch.module and launch.training_script == "some.module"
        assert launch.training_script_args == ["--flag", "1"]


# ------------------------------------------------------------------------------------------------------------
# The launcher refuses before torchrun starts
# ------------------------------------------------------------------------------------------------------------

def _environment(**env) -> dict:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    return {**environment, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env}


def _launcher(*argv, **env) -> subprocess.CompletedProcess:
    # 60 s: the refusal takes the few seconds of parsing the flags; ranks that started would take longer.
    return subprocess.run([sys.executable, "-m", "megatron_patch.training.launcher", *argv], env=_environment(**env),
                          capture_output=True, text=True, timeout=60)


def _assert_refused_before_torchrun(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = result.stderr.splitlines()  # one line: no traceback, no warning, nothing from a rank
    assert line.startswith("rapidformer: error: ") and message in line, line
    # The launcher prints "+ <torchrun command>" before it starts the ranks; nothing of it came.
    assert result.stdout == ""


TASK = ["--task", "pretraining", "--mock-data", "--train-iters", "1"]


@pytest.mark.parametrize("flags, message", [
    # tiny-gpt2 has 4 heads.
    (["--nproc-per-node", "3", "--model-name", "tiny-gpt2", "--tensor-model-parallel-size", "3"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    # The shape flags alone describe a model too.
    (["--nproc-per-node", "2", "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
      "--seq-length", "32", "--pipeline-model-parallel-size", "2"],
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--nproc-per-node", "2", "--model-name", "tiny-gpt2", "--micro-batch-size", "2", "--global-batch-size", "6"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"),
])
def test_the_launcher_refuses_a_bad_layout_before_torchrun(flags, message):
    _assert_refused_before_torchrun(_launcher(*TASK, *flags), message)


def test_the_world_counts_every_node():
    """NNODES x --nproc-per-node is the world: 2 x 1 processes leave DP 2, which 3 sequences do not split into."""
    result = _launcher(*TASK, "--nproc-per-node", "1", "--model-name", "tiny-gpt2", "--global-batch-size", "3",
                       NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    _assert_refused_before_torchrun(result, "--global-batch-size 3 is not divisible by --micro-batch-size 1 x "
                                            "data-parallel size 2 (world 2 / ")


def test_the_launcher_checks_the_model_of_the_checkpoint_to_load(tmp_path):
    """--load's megatron_patch_args.json describes the model: tiny-llama's 2 query groups do not split over TP 4."""
    from megatron_patch.checkpoint.format import CheckpointInfo, write_args_file
    from megatron_patch.model import get_model_config

    write_args_file(str(tmp_path), CheckpointInfo("torch_dist", get_model_config("tiny-llama"), 128))
    result = _launcher(*TASK, "--nproc-per-node", "4", "--load", str(tmp_path), "--tensor-model-parallel-size", "4")
    _assert_refused_before_torchrun(result, "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4")


def test_the_recipe_leaves_the_layout_to_the_launcher(tmp_path):
    """The run_*.sh recipes pass the sizes on; the launcher refuses them before any rank starts."""
    result = subprocess.run(["bash", GPT_RECIPE, "--cpu", "--nproc-per-node", "3", "--tp", "3", "--output-dir",
                             str(tmp_path / "out")], cwd=tmp_path, env=_environment(), capture_output=True, text=True,
                            timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    errors = [line for line in output.splitlines() if "error" in line]
    assert errors == ["rapidformer: error: --num-attention-heads 4 is not divisible by --tensor-model-parallel-size "
                      "3; choose a --tensor-model-parallel-size that divides it"], output
    assert "torch.distributed.run" not in output and "Traceback" not in output


# tiny-mixtral has 4 experts of width 32 (tiny-llama none); each is what the ranks would refuse after they started,
# as are the layouts that need Transformer Engine's layers.
_MOE_REFUSALS = [
    (["--model-name", "tiny-mixtral", "--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts 6 is not divisible by --expert-model-parallel-size 4"),
    (["--model-name", "tiny-mixtral", "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "4"],
     "world size 4 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4 x "
     "--pipeline-model-parallel-size 2 = 8"),
    (["--model-name", "tiny-llama", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size splits the experts of a mixture-of-experts model, and this model has none"),
    (["--model-name", "tiny-mixtral", "--tensor-model-parallel-size", "2"],
     "mixture-of-experts layers with --tensor-model-parallel-size greater than 1 need --sequence-parallel"),
    (["--model-name", "tiny-mixtral", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
     "--moe-token-dispatcher-type alltoall with expert tensor parallelism 2 needs NCCL"),
    (["--model-name", "tiny-mixtral", "--moe-grouped-gemm"], "--moe-grouped-gemm needs Transformer Engine"),
    (["--model-name", "tiny-mixtral", "--moe-token-dispatcher-type", "flex"],
     "--moe-token-dispatcher-type flex needs DeepEP or HybridEP"),
    # Failed before: refused only by each rank, with its traceback, after torchrun had started them.
    pytest.param(["--model-name", "tiny-llama", "--context-parallel-size", "2"],
                 "--context-parallel-size greater than 1 needs Transformer Engine, but Transformer Engine is not "
                 "installed", marks=pytest.mark.skipif(transformer_engine_available(), reason="TE is installed")),
    (["--model-name", "tiny-llama", "--context-parallel-size", "2", "--transformer-impl", "local"],
     "--context-parallel-size greater than 1 needs Transformer Engine, but --transformer-impl local is given"),
]


@pytest.mark.parametrize("flags, message", _MOE_REFUSALS)
def test_the_launcher_refuses_a_bad_expert_or_backend_layout_before_torchrun(monkeypatch, flags, message):
    """launch_command is the launcher's check (check_launch_layout) before it builds the torchrun command; in this
    process, so that a layout it let through starts no ranks here."""
    from megatron_patch.training.launcher import launch_command

    monkeypatch.delenv("NNODES", raising=False)
    with pytest.raises(SystemExit) as refusal:
        launch_command([*TASK, "--nproc-per-node", "4", *flags])
    assert str(refusal.value).startswith("rapidformer: error: ") and message in str(refusal.value)


def test_the_launcher_passes_an_expert_layout_on(monkeypatch):
    from megatron_patch.training.launcher import launch_command

    monkeypatch.delenv("NNODES", raising=False)
    expert_flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    command = launch_command([*TASK, "--nproc-per-node", "4", "--model-name", "tiny-mixtral", *expert_flags])
    assert command[-len(expert_flags):] == expert_flags
