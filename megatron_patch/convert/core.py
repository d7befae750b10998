"""Hugging Face <-> Megatron conversion: check everything first, then stream tensor by tensor.

Example::

    from megatron_patch.convert.core import hf_to_megatron, megatron_to_hf
    info = hf_to_megatron("llama-hf", "llama-mcore")                       # torch_dist, loads at any TP/PP/EP
    hf_to_megatron("llama-hf", "llama-legacy", ckpt_format="torch", target_tensor_parallel_size=2)
    megatron_to_hf("llama-mcore", "llama-hf-again")                        # from either format

Before any data is read, the names and shapes in the Hugging Face files are checked against what config.json
implies (missing, extra, mis-shaped tensors are errors naming the tensor and both shapes). Output goes to a
``<dir>.partial-<host>-<pid>`` sibling that is renamed into place only when everything is written, so a failed run
leaves nothing under the final name; what a killed run left is removed by the next run into the same directory.

Tensors pass through megatron-core's own model at TP=1, PP=1, EP=1 (:func:`build_reference_model`, on the meta
device when only its names, shapes and sharding are needed); the Megatron files themselves, either format, are
written and read by :mod:`megatron_patch.checkpoint`. A mixture-of-experts model's torch_dist checkpoint holds every
expert under its global index (megatron-core's sharded keys), so loading it at expert parallelism EP hands each EP
rank its own experts, and loading at EP=1 for an export gathers them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import sys
import threading
from typing import Callable

import torch

from megatron_patch import compat
from megatron_patch.checkpoint.format import (
    ARGS_FILE, DTYPES, TOKENIZER_DIR, CheckpointInfo, CheckpointMismatch, dtype_name, full_state_dict, read_info,
    write_info,
)
from megatron_patch.checkpoint.legacy import save_legacy
from megatron_patch.checkpoint.load import load_into_reference_model
from megatron_patch.checkpoint.lora import read_lora_record
from megatron_patch.checkpoint.torch_dist import stream_dist
from megatron_patch.convert import lora as lora_export
from megatron_patch.model.conversion import (
    FAMILIES, Family, Rule, Table, UnsupportedCheckpoint, architecture_of, family_for, recognised_model_type,
    recognised_model_types,
)
from megatron_patch.convert.hf_io import HFReader, ShardedSafetensorsWriter, copy_tokenizer_files, read_hf_config
from megatron_patch.convert.startup import import_megatron_core
from megatron_patch.convert.transforms import Shapes, apply_to_hf, apply_to_mcore, row_runs
from megatron_patch.distributed import initialize_distributed, one_rank_world, start_one_rank_world
from megatron_patch.errors import UserError, first_problems
from megatron_patch.layout import LayoutError
from megatron_patch.model.config import SETTINGS, ModelConfig
from megatron_patch.staging import killed_leftovers, staging_tag, tag_pattern


class ConversionError(UserError, ValueError):
    """The input cannot be converted exactly; the message names the tensors and shapes involved."""


def shapes_of(model_config: ModelConfig, padded_vocab: int) -> Shapes:
    return Shapes(model_config.num_attention_heads, model_config.num_query_groups, model_config.kv_channels,
                  model_config.vocab_size, padded_vocab)


@contextlib.contextmanager
def atomic_directory(final_dir: str, overwrite: bool = False):
    """Yield a temporary sibling of ``final_dir``; rename it to ``final_dir`` only if the block succeeds.

    Example::

        with atomic_directory("llama-mcore") as tmp:    # llama-mcore.partial-<host>-<pid>
            write_checkpoint(tmp)

    What a killed conversion into ``final_dir`` left is cleared first (:func:`remove_killed_staging`).
    """
    final_dir = os.path.abspath(final_dir)
    remove_killed_staging(final_dir)
    if os.path.exists(final_dir) and os.listdir(final_dir) and not overwrite:
        raise FileExistsError(f"{final_dir} exists and is not empty; choose another directory or pass --overwrite")
    tmp = final_dir + staging_tag("partial")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final_dir):
        old = final_dir + staging_tag("old")
        os.replace(final_dir, old)
        os.replace(tmp, final_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final_dir)


def remove_killed_staging(final_dir: str) -> None:
    """Clear what conversions into ``final_dir`` that were killed on this host left behind.

    Example::

        remove_killed_staging("/ckpt/llama-mcore")   # removes /ckpt/llama-mcore.partial-node1-4242 if 4242 is dead

    A SIGKILL (the out-of-memory killer, a scheduler's hard limit) runs no cleanup, and a conversion's directory is
    as large as the model. A ``.partial-`` directory of a dead process is removed. An ``.old-`` one is the previous
    checkpoint, moved aside for the instant of the swap: it goes back under ``final_dir`` if the swap never
    finished, and is removed if it did.
    """
    parent, base = os.path.split(final_dir)
    for path, pid, found in killed_leftovers(parent, re.escape(base) + tag_pattern("(?P<kind>partial|old)")):
        if found["kind"] == "old" and not os.path.exists(final_dir):
            os.replace(path, final_dir)
            print(f"note: restored {final_dir} from {path}: process {pid} was killed while replacing it",
                  file=sys.stderr, flush=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
            print(f"note: removed {path}, left by process {pid}, a conversion that was killed", file=sys.stderr,
                  flush=True)


class _Progress:
    """Tensors and bytes done, on one tqdm bar (stderr, a terminal only: its \\r redraws garble a log)."""

    def __init__(self, desc: str, total_bytes: int, total_tensors: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc,
                        disable=not enabled or not sys.stderr.isatty(), file=sys.stderr, dynamic_ncols=True)
        self.total_tensors, self.tensors = total_tensors, 0

    def update(self, nbytes: int) -> None:
        self.tensors += 1
        self.bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        self.bar.close()


def build_reference_model(model_config: ModelConfig, padded_vocab_size: int, dtype: torch.dtype = torch.float32,
                          allocate_only: bool = False, meta: bool = False):
    """megatron-core's model at TP=1, PP=1 in this process (a world of one rank, started when there is none: inside
    ``distributed.one_rank_world()`` it is destroyed when the block ends, as the conversions here do).

    ``allocate_only`` skips the random initialisation of a model whose every tensor is about to be overwritten
    (it is built on the meta device, then given uninitialised memory): seconds saved per billion parameters.
    ``meta`` leaves it on the meta device: names, shapes and sharding without memory (for :func:`stream_dist`).
    """
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.parallel import ParallelConfig

    start_one_rank_world()
    initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=1234)
    # megatron-core's local layers even where Transformer Engine is installed: the conversion tables name their
    # tensors, the model stays in this process's memory, and their checkpoints load into TE's layers.
    parallel = ParallelConfig(precision={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"),
                              transformer_impl="local")
    if not (allocate_only or meta):
        [model] = build_model_chunks(model_config, parallel, padded_vocab_size)
        return model
    with torch.device("meta"):
        # A model left on the meta device only lends names, shapes and sharding. One given memory keeps megatron-core's
        # initialisation: without it, exporting per-rank files saved at PP > 1 found the last stage's output layer
        # differing from the tied embeddings (tests/test_convert.py).
        [model] = build_model_chunks(model_config, parallel, padded_vocab_size, initialize=not meta)
    if meta:
        return model
    # to_empty makes new Parameters; megatron's attributes on them (partition_dim, shared, ...) must survive.
    attributes = {name: dict(vars(param)) for name, param in model.named_parameters()}
    model.to_empty(device="cpu")
    for name, param in model.named_parameters():
        vars(param).update(attributes[name])
    return model


def _check_hf_names(reader: HFReader, rules: list[Rule], ignored: tuple[str, ...], hf_dir: str) -> None:
    wanted = {name for r in rules for name in r.hf}
    present = set(reader.names())
    missing = sorted(wanted - present)
    extra = sorted(n for n in present - wanted if not any(re.fullmatch(p, n) for p in ignored))
    problems = [f"missing tensor {n} (expected shape from config.json)" for n in missing]
    problems += [f"unexpected tensor {n} {tuple(reader.shape(n))} (not part of this architecture)" for n in extra]
    if problems:
        raise ConversionError(f"{hf_dir}: the weights do not match config.json: {first_problems(problems)}; "
                              "give the weights and config.json of one model (a download may be incomplete)")


def _check_copies(reader: HFReader, rules: list[Rule], hf_dir: str) -> None:
    """Tensors a rule reads as copies of one megatron tensor (``shared_copy``) must be equal, or the conversion would
    drop one of two different matrices."""
    for r in rules:
        copies = r.transforms.count("shared_copy")
        for name in r.hf[1:1 + copies]:
            if not torch.equal(reader.get(r.hf[0]), reader.get(name)):
                raise ConversionError(f"{hf_dir}: {name} differs from {r.hf[0]}; megatron-core's {r.mcore} is one "
                                      "tensor for both, so the model cannot hold this checkpoint exactly")


def _check_hf_shapes(reader: HFReader, rules: list[Rule], target: dict, shapes: Shapes, hf_dir: str) -> None:
    problems = []
    for r in rules:
        expected = apply_to_hf(r.transforms, torch.empty(target[r.mcore].shape, device="meta"), shapes)
        for name, tensor in zip(r.hf, expected):
            if tuple(reader.shape(name)) != tuple(tensor.shape):
                problems.append(f"tensor {name}: checkpoint has shape {tuple(reader.shape(name))}, config.json "
                                f"implies {tuple(tensor.shape)}")
    if problems:
        raise ConversionError(f"{hf_dir}: the weights do not match config.json: {first_problems(problems)}; "
                              "give the weights and config.json of one model")


def _check_coverage(rules: list[Rule], table: Table, target: dict) -> list[str]:
    """The megatron tensors the table cannot fill (allowed only for reported missing heads)."""
    produced = {r.mcore for r in rules}
    unknown = sorted(produced - set(target))
    if unknown:
        raise ConversionError(f"the mapping table names megatron tensors the model does not have: {unknown}")
    uncovered = sorted(set(target) - produced)
    unexplained = [n for n in uncovered if not n.startswith(table.missing_mcore_prefixes)]
    if unexplained:
        raise ConversionError(f"the mapping table leaves megatron tensors unfilled: {unexplained}")
    return uncovered


@dataclasses.dataclass
class _Source:
    hf_config: dict
    family: Family
    architecture: str
    model_config: ModelConfig
    table: Table


def _source(hf_dir: str, make_vocab_size_divisible_by: int = 128) -> _Source:
    """The model ``hf_dir``'s config.json describes; what it cannot describe is an error naming the directory."""
    hf_config = read_hf_config(hf_dir)
    try:
        family = family_for(hf_config)
        architecture = architecture_of(hf_config, family)
        model_config = family.config_from_hf(hf_config).replace(
            make_vocab_size_divisible_by=make_vocab_size_divisible_by
        )
        if family.held_by_files is not None:
            model_config = family.held_by_files(model_config, HFReader(hf_dir).names())
    except UnsupportedCheckpoint as error:  # its message names config.json's field, not which config.json
        raise UnsupportedCheckpoint(f"{hf_dir}: {error}") from None
    except KeyError as error:
        raise UnsupportedCheckpoint(f"{os.path.join(hf_dir, 'config.json')} has no {error.args[0]!r}, which a "
                                    f"{hf_config['model_type']} config needs; restore the model's config.json "
                                    "(save_pretrained writes it)") from None
    except ValueError as error:  # ModelConfig.validate: sizes that describe no model
        raise UnsupportedCheckpoint(f"{os.path.join(hf_dir, 'config.json')}: {error}") from None
    return _Source(hf_config, family, architecture, model_config, family.table(model_config, architecture))


# The fields that fix the model's family or a tensor's shape (Setting.shape). A pair that differs in one of them is
# two models, and verify must say so before building either: it used to build the checkpoint's model type from the
# other directory's config.json, where transformers' defaults filled the gaps (a GPT-2 directory next to a LLaMA
# checkpoint: LLaMA-7B, 16.8 GB).
_PAIRED_FIELDS = tuple(s.name for s in SETTINGS.values() if s.shape)


def check_pair(hf_dir: str, megatron_dir: str) -> tuple[CheckpointInfo, str]:
    """Check that ``hf_dir`` holds the model of the Megatron checkpoint ``megatron_dir``, from their config files
    only; return the checkpoint's description and the Hugging Face class to compare it with.

    Example::

        info, architecture = check_pair("llama-hf", "llama-mcore")     # (CheckpointInfo(...), "LlamaForCausalLM")
        check_pair("gpt2-hf", "llama-mcore")    # CheckpointMismatch: ... model_type gpt2 vs llama; ...

    A checkpoint our trainer started from scratch records no Hugging Face config: its model (family and shapes)
    is compared, and the class is ``hf_dir``'s (its export, say).
    """
    info = read_info(megatron_dir)
    src = _source(hf_dir)
    pairs = []
    if info.hf_config and "model_type" in info.hf_config:
        pairs.append(("model_type", src.hf_config.get("model_type"), info.hf_config["model_type"]))
    if info.hf_architecture:
        pairs.append(("architecture", src.architecture, info.hf_architecture))
    # Every MLP of a MoE model is experts: no tensor has ffn_hidden_size's shape (Mixtral's config.json has only the
    # experts' width, which a model trained with a wider ffn_hidden_size exports as its intermediate_size).
    m = info.model_config
    all_experts = all(m.is_moe_layer(i) for i in range(m.num_layers))
    pairs += [(name, getattr(src.model_config, name), getattr(info.model_config, name)) for name in _PAIRED_FIELDS
              if not (all_experts and name == "ffn_hidden_size")]
    differing = [f"{name} {hf} vs {megatron}" for name, hf, megatron in pairs if hf != megatron]
    if differing:
        raise CheckpointMismatch(
            f"--hf-dir {hf_dir} (config.json) and --megatron-dir {megatron_dir} ({ARGS_FILE}) hold different "
            f"models: {first_problems(differing)}; pass the Hugging Face directory this checkpoint was converted "
            "from or exported to"
        )
    return info, info.hf_architecture or src.architecture


# megatron-core keeps a router's expert bias in fp32 whatever the parameters' dtype (router.py,
# _maintain_float32_expert_bias at core_v0.16.1), as DeepSeek-V3's bf16 checkpoints keep e_score_correction_bias.
_FP32_ALWAYS = ".router.expert_bias"


def _checkpoint_dtype(reader: HFReader, rules: list[Rule]) -> str:
    dtypes = {reader.dtype(name) for r in rules if not r.mcore.endswith(_FP32_ALWAYS) for name in r.hf}
    name = dtype_name(next(iter(dtypes))) if len(dtypes) == 1 else None
    if name is None:
        raise UnsupportedCheckpoint(f"the checkpoint's tensors have dtypes {sorted(map(str, dtypes))}; conversion "
                                    f"needs one of {', '.join(DTYPES)} throughout")
    return name


# How far reading may run ahead of its use, in bytes of Hugging Face tensors held: enough to cover megatron-core's
# import (seconds) at page-cache speed, small beside the models converted.
_READ_AHEAD_BYTES = 1 << 30


class _ReadAhead:
    """Rules' megatron tensors made on a helper thread, in the given order, and held until taken, at most
    ``budget`` bytes of them at a time (one larger tensor alone may exceed it).

    Example::

        ahead = _ReadAhead(make, rules, nbytes, 1 << 30)
        tensor = ahead.take(name)   # made already (or being made: waits), else None: make it yourself
        ahead.close()

    ``make`` reads files (``pread`` releases the GIL), so the reading overlaps megatron-core's import and then the
    writing. A tensor taken before the helper reached it leaves the helper's queue; if ``make`` raises, the helper
    stops and the caller, making the rest itself, meets the same error where it always did.
    """

    def __init__(self, make: Callable[[Rule], torch.Tensor], rules: list[Rule], nbytes: Callable[[Rule], int],
                 budget: int):
        self._make, self._nbytes, self._budget = make, nbytes, budget
        self._queue = {r.mcore: r for r in rules}
        self._ready: dict[str, tuple[torch.Tensor, int]] = {}
        self._held = 0
        self._making: str | None = None
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                while (not self._closed and self._queue and self._held
                       and self._held + self._nbytes(next(iter(self._queue.values()))) > self._budget):
                    self._changed.wait()
                if self._closed or not self._queue:
                    return
                name = next(iter(self._queue))
                rule = self._queue.pop(name)
                self._making = name
            try:
                tensor = self._make(rule)
            except Exception:  # the caller makes this one itself and meets the error there
                tensor = None
            with self._changed:
                self._making = None
                if tensor is not None:
                    self._ready[name] = tensor, self._nbytes(rule)
                    self._held += self._nbytes(rule)
                self._changed.notify_all()
            if tensor is None:
                return

    def take(self, name: str) -> torch.Tensor | None:
        with self._changed:
            self._queue.pop(name, None)
            while self._making == name:
                self._changed.wait()
            if name not in self._ready:
                return None
            tensor, nbytes = self._ready.pop(name)
            self._held -= nbytes
            self._changed.notify_all()
            return tensor

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        self._ready.clear()


@one_rank_world()
def hf_to_megatron(
    hf_dir: str,
    save_dir: str,
    ckpt_format: str = "torch_dist",
    target_tensor_parallel_size: int = 1,
    target_pipeline_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
    progress: bool = True,
    check: Callable[[str], None] | None = None,
    target_expert_model_parallel_size: int = 1,
) -> CheckpointInfo:
    """Convert a Hugging Face directory into a Megatron checkpoint directory; return what was recorded.

    ``check(staged_dir)`` (verification) runs on the finished checkpoint under its temporary name: when it raises,
    nothing is left under ``save_dir`` and a checkpoint already there (``overwrite``) is kept.

    ``torch_dist`` loads at any TP/PP (the vocabulary is padded for ``target_tensor_parallel_size``; any TP that
    divides ``make_vocab_size_divisible_by x target TP`` works); ``torch`` writes Megatron-LM's per-rank files
    for exactly the target TP x PP. ``torch_dist`` is streamed: tensors are read (a helper thread running up to
    ``_READ_AHEAD_BYTES`` ahead, from before megatron-core is imported) and written one at a time, so memory holds
    at most that much of the model (plus the libraries), not all of it. A MoE model's experts are
    split over ``target_expert_model_parallel_size`` ranks when the torch_dist checkpoint loads (here the target
    is only checked: it must divide the experts).
    """
    # Here, not at the top: the tokenizer package imports megatron-core (seconds), which check_pair must not wait for.
    from megatron_patch.tokenizer.registry import padded_vocab_size

    src = _source(hf_dir, make_vocab_size_divisible_by)
    m = src.model_config
    _check_expert_target(m, ckpt_format, target_tensor_parallel_size, target_expert_model_parallel_size)
    check_layout_of(m, target_tensor_parallel_size, target_pipeline_parallel_size, target_expert_model_parallel_size,
                    flags=_TARGET_FLAGS)
    padded = padded_vocab_size(m.vocab_size, make_vocab_size_divisible_by, target_tensor_parallel_size)
    rules = src.table.expanded(m.num_layers)
    reader = HFReader(hf_dir)
    _check_hf_names(reader, rules, src.table.ignored_hf, hf_dir)
    dtype = _checkpoint_dtype(reader, rules)
    info = CheckpointInfo(
        format=ckpt_format, model_config=m, padded_vocab_size=padded, dtype=dtype,
        tensor_model_parallel_size=target_tensor_parallel_size if ckpt_format == "torch" else 1,
        pipeline_model_parallel_size=target_pipeline_parallel_size if ckpt_format == "torch" else 1,
        hf_config=src.hf_config, hf_architecture=src.architecture,
    )
    shapes = shapes_of(m, padded)
    by_name = {r.mcore: r for r in rules}

    def make(r: Rule) -> torch.Tensor:
        """Rule ``r``'s megatron tensor, read and transformed from its Hugging Face tensors."""
        hf_shapes = tuple(tuple(reader.shape(n)) for n in r.hf)
        runs = row_runs(r.transforms, hf_shapes, shapes)
        if runs is None:
            [tensor] = apply_to_mcore(r.transforms, [reader.get(n) for n in r.hf], shapes)
            return tensor
        # Each Hugging Face row read where it belongs: no intermediate copies.
        return reader.read_runs(r.hf, runs, (sum(run.rows for run in runs), *hf_shapes[0][1:]))

    def nbytes(r: Rule) -> int:
        return sum(reader.nbytes(n) for n in r.hf)

    # The largest first: the order in which megatron-core's torch_dist writer asks (DCP writes by size).
    ahead = _ReadAhead(make, sorted(rules, key=nbytes, reverse=True), nbytes, _READ_AHEAD_BYTES)
    try:
        # The seconds of megatron-core's import pass while the first weights are read.
        import_megatron_core()
        compat.apply()
        with atomic_directory(save_dir, overwrite) as tmp:
            # Heads the checkpoint lacks keep megatron-core's own initialisation, so only then is it run;
            # torch_dist otherwise needs no memory for the model (stream_dist), the legacy files need it filled.
            initialise, stream = bool(src.table.missing_mcore_prefixes), ckpt_format == "torch_dist"
            model = build_reference_model(m, padded, DTYPES[dtype].torch, allocate_only=not (initialise or stream),
                                          meta=stream and not initialise)
            target = full_state_dict(model)
            info.initialized_tensors = _check_coverage(rules, src.table, target)
            if info.initialized_tensors:
                print(f"WARNING: {src.architecture} has no {', '.join(src.table.missing_mcore_prefixes)} weights; "
                      f"megatron's {info.initialized_tensors} are randomly initialised (recorded in the checkpoint "
                      "and left out of exports)", file=sys.stderr)
            _check_hf_shapes(reader, rules, target, shapes, hf_dir)
            _check_copies(reader, rules, hf_dir)
            bar = _Progress("hf-to-megatron", sum(map(nbytes, rules)), len(rules), progress)

            def produce(name: str) -> torch.Tensor:
                """The full megatron tensor ``name``."""
                if name not in by_name:
                    return target[name]  # an initialised head
                tensor = ahead.take(name)
                if tensor is None:
                    tensor = make(by_name[name])
                bar.update(nbytes(by_name[name]))
                return tensor

            # Before the weights: Megatron-LM's args in them name the tokenizer only when there is one.
            info.tokenizer_files = copy_tokenizer_files(hf_dir, os.path.join(tmp, TOKENIZER_DIR))
            weights = os.path.join(tmp, "release")
            if stream:
                stream_dist(model, weights, produce, info)
            else:
                with torch.no_grad():
                    for name, tensor in target.items():
                        tensor.copy_(produce(name))
                save_legacy(model, weights, info)
            bar.close()
            write_info(tmp, info)
            if check is not None:
                check(tmp)
    finally:
        ahead.close()
    return info


# hf-to-megatron's names for the layout flags of megatron_patch.layout's messages.
_TARGET_FLAGS = {"--tensor-model-parallel-size": "--target-tensor-parallel-size",
                 "--pipeline-model-parallel-size": "--target-pipeline-parallel-size",
                 "--expert-model-parallel-size": "--target-expert-model-parallel-size"}


def check_layout_of(m: ModelConfig, tp: int, pp: int, ep: int = 1, padded_vocab_size: int | None = None,
                    flags: dict[str, str] | None = None) -> None:
    """Refuse, before anything is read, a TP x PP x EP layout ``m`` cannot be split into (megatron_patch.layout's one
    check), naming the layout flags as ``flags`` renames them.

    Example::

        check_layout_of(model_config, tp=3, pp=1)   # ConversionError: --num-attention-heads 4 is not divisible ...

    Otherwise the conversion read and wrote every weight first, and each rank of its verification failed alone.
    """
    from megatron_patch.model.parallel import ParallelConfig

    # megatron-core's MoE layers at TP > 1 need sequence parallelism, which verify turns on.
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep, sequence_parallel=tp > 1 and m.num_moe_experts is not None)
    try:
        parallel.check_layout(m, padded_vocab_size=padded_vocab_size)
    except LayoutError as error:
        message = str(error)
        for theirs, ours in (flags or {}).items():
            message = message.replace(theirs, ours)
        raise ConversionError(message) from None


def _check_expert_target(m: ModelConfig, ckpt_format: str, tp: int, ep: int) -> None:
    if m.num_moe_experts is None:
        if ep > 1:
            raise ConversionError(f"--target-expert-model-parallel-size {ep}: the model has no experts; drop the flag")
        return
    if m.num_moe_experts % ep:
        raise ConversionError(f"--target-expert-model-parallel-size {ep} does not divide the {m.num_moe_experts} "
                              "experts; pick a divisor")
    # checkpoint.legacy cuts a swiglu fc1 per rank only under mlp.linear_fc1 and names rank files without expert
    # ranks, so a MoE model's per-rank files exist only for one rank.
    if ckpt_format == "torch" and (tp > 1 or ep > 1):
        raise ConversionError(f"--ckpt-format torch writes a mixture-of-experts model only at TP=1, EP=1 (asked: "
                              f"TP={tp}, EP={ep}); use --ckpt-format torch_dist, which loads at any TP/PP/EP")


@one_rank_world()
def megatron_to_hf(
    load_dir: str,
    save_dir: str,
    model_type: str | None = None,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = 5 << 30,
    overwrite: bool = False,
    progress: bool = True,
    merge_lora: bool = False,
) -> str:
    """Export a Megatron checkpoint (either format, any TP/PP) to a Hugging Face directory; return its path.

    ``model_type`` is needed only for checkpoints without a recorded Hugging Face config (trained from scratch, or
    saved by Megatron-LM: their model comes from the ``args`` they carry) whose model is not one a type is
    recognised from (``conversion.recognised_model_type``: a LLaMA or a GPT-2 block). A LoRA checkpoint
    (``checkpoint.lora``) is written as a PEFT adapter directory for its base, or with ``merge_lora`` as the
    base with the adapters merged in (``convert.lora``).
    """
    info = read_info(load_dir)
    hf_config = dict(info.hf_config or {})
    if model_type:
        hf_config["model_type"] = model_type
    if "model_type" not in hf_config:
        recognised = recognised_model_type(info.model_config)
        if recognised is None:
            raise UnsupportedCheckpoint(
                f"{load_dir} records no Hugging Face config and its model is none of the types recognised from a "
                f"checkpoint's args ({', '.join(recognised_model_types())}); pass --model-type, one of "
                f"{', '.join(sorted(FAMILIES))}")
        hf_config["model_type"] = recognised
    family = family_for(hf_config)
    architecture = info.hf_architecture or family.architectures[0]
    m = info.model_config
    # Before the weights are read: a model the family cannot express is refused by name.
    fields, table = family.config_to_hf(m), family.table(m, architecture)
    model = build_reference_model(m, info.padded_vocab_size, DTYPES[info.dtype].torch, allocate_only=True)
    lora = read_lora_record(load_dir)
    if lora is None:
        if merge_lora:
            raise UserError(f"--merge-lora: {load_dir} is not a LoRA checkpoint (it holds a whole model); drop the "
                            "flag")
        load_into_reference_model(model, load_dir, info)
    else:
        lora_export.load_lora_reference(model, load_dir, lora)
    state = full_state_dict(model)
    if lora is not None and not merge_lora:
        with atomic_directory(save_dir, overwrite) as tmp:
            lora_export.write_peft_adapter(tmp, state, table.expanded(m.num_layers),
                                           shapes_of(m, info.padded_vocab_size), lora,
                                           base_model=(info.hf_config or {}).get("_name_or_path"))
        return save_dir
    if lora is not None:
        state = lora_export.merge_adapters(state, lora)
    if m.layernorm_zero_centered_gamma and not family.zero_centered_norms:
        from megatron_patch.model.layers import ZeroCenteredNorm

        # --apply-layernorm-1p keeps gamma - 1 in the norms' weights (model/layers.py); this family's hold gamma.
        for name, module in model.named_modules():
            if isinstance(module, ZeroCenteredNorm):
                state[f"{name}.weight"] = state[f"{name}.weight"] + 1
    rules = table.expanded(m.num_layers)
    _check_coverage(rules, table, state)
    shapes = shapes_of(m, info.padded_vocab_size)
    with atomic_directory(save_dir, overwrite) as tmp:
        bar = _Progress("megatron-to-hf", sum(state[r.mcore].nbytes for r in rules), len(rules), progress)
        with ShardedSafetensorsWriter(tmp, max_shard_bytes) as writer:
            for r in rules:
                for name, tensor in zip(r.hf, apply_to_hf(r.transforms, state[r.mcore], shapes)):
                    writer.add(name, tensor)
                bar.update(state[r.mcore].nbytes)
        bar.close()
        # A LoRA checkpoint holds adapters only: the merged model's tokenizer is its base's.
        copied = copy_tokenizer_files(tokenizer_dir or os.path.join(lora["lora_base"] if lora else load_dir,
                                                                    TOKENIZER_DIR), tmp)
        if copied and not info.hf_config:
            hf_config.update(_special_token_ids(tmp, family))
        _write_hf_config(tmp, family.model_type, architecture, fields, hf_config, info.dtype)
    return save_dir


def _special_token_ids(tokenizer_dir: str, family: Family) -> dict[str, int]:
    """``bos/eos/pad_token_id`` of the tokenizer an export carries, for a model trained from scratch: without
    them transformers' defaults apply (GPT-2's 50256), which point past a vocabulary of a few thousand."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, config=AutoConfig.for_model(family.model_type))
    return {f"{kind}_token_id": getattr(tokenizer, f"{kind}_token_id") for kind in ("bos", "eos", "pad")
            if getattr(tokenizer, f"{kind}_token_id") is not None}


def _write_hf_config(out_dir: str, model_type: str, architecture: str, model_fields: dict, recorded: dict,
                     dtype: str) -> None:
    """config.json: the recorded Hugging Face config, with every field the model defines (``model_fields``, from
    the Megatron model config, which training may have changed), completed by transformers' defaults."""
    from transformers import AutoConfig

    fields = {k: v for k, v in recorded.items() if k not in ("model_type", "transformers_version")}
    fields.update(model_fields, architectures=[architecture], dtype=dtype)
    AutoConfig.for_model(model_type, **fields).save_pretrained(out_dir)
