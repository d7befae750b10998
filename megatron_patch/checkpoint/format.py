"""What a Megatron checkpoint directory is made of: its file names, its tracker and its description.

Example::

    read_tracker("ckpt")                        # 100, "release" for a conversion, None before the first save
    weights_dir("ckpt")                         # "ckpt/iter_0000100"
    info = read_info("ckpt")                    # megatron_patch_args.json, else Megatron-LM's own args
    info.model_config.hidden_size, info.dtype   # (4096, "bfloat16")

Layout of a directory (Megatron-LM's, so its ``--load`` finds the weights)::

    latest_checkpointed_iteration.txt           the tracker: "100", or "release" for a converted checkpoint
    megatron_patch_args.json                    CheckpointInfo: ModelConfig, padded vocabulary, dtype, HF config, format
    iter_0000100/ or release/                   torch_dist: metadata.json, *.distcp, common.pt with ``args``
    iter_0000100/mp_rank_TT[_PPP]/model_optim_rng.pt   torch: one file per TP (x PP) rank, with ``args``
    iter_0000100/rng/rank_RRRRR.pt              our trainer's RNG state per rank; checksums.json (integrity.py)
    hf_tokenizer/                               the tokenizer files given at conversion

A checkpoint Megatron-LM's own ``save_checkpoint`` wrote has no ``megatron_patch_args.json``; :func:`read_info`
then takes the model from the ``args`` in its common.pt or ``mp_rank_00*/model_optim_rng.pt``
(:func:`info_from_megatron_lm`), the format from the files present. The other way, :func:`megatron_lm_common_state`
writes those ``args`` into ours, so Megatron-LM resumes our checkpoints with ``--use-checkpoint-args``.

Tensors are named as in megatron-core's TP=1, PP=1 model (``model.names``: ``decoder.layers.3.mlp.linear_fc1.weight``,
layers numbered across all stages); :func:`partition_dims` says along which dimension each is split over TP.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import pickle
import re
import zipfile
from typing import TYPE_CHECKING, NamedTuple

from megatron_patch import compat
from megatron_patch.errors import UserError, read_json
from megatron_patch.model.config import SETTINGS, ModelConfig
from megatron_patch.model.names import LAYER

ARGS_FILE = "megatron_patch_args.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
TOKENIZER_DIR = "hf_tokenizer"
_COMPLETE = re.compile(r"iter_(\d{7})")

if TYPE_CHECKING:
    import torch


class Dtype(NamedTuple):
    name: str
    """torch's (and Hugging Face's) name: ``torch.<name>``."""
    flag: str
    """Megatron-LM's name: ``--params-dtype``'s value, set by ``--bf16``/``--fp16`` (``fp32`` without either)."""

    @property
    def torch(self) -> torch.dtype:
        import torch  # here, not at the top: `rapidformer --help` reads this module and must not pay for torch

        return getattr(torch, self.name)


# The stored weights' dtypes, by the name megatron_patch_args.json and `convert verify --dtype` use (Hugging Face's).
DTYPES = {name: Dtype(name, flag) for name, flag in (("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16"))}


def dtype_name(dtype: torch.dtype | str) -> str | None:
    """The name in :data:`DTYPES` of a torch dtype or a ``--params-dtype`` value; None for another dtype.

    Example::

        >>> import torch
        >>> dtype_name("bf16"), dtype_name(torch.float16), dtype_name(torch.int8)
        ('bfloat16', 'float16', None)
    """
    text = str(dtype).removeprefix("torch.")  # a torch dtype prints as torch.float16
    return next((name for name, known in DTYPES.items() if text in known), None)


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete_iterations(root: str) -> list[int]:
    """The iterations of ``root``'s ``iter_*`` directories, oldest first; ``*.tmp-*`` saves in progress (or
    killed) are not among them.

    Example::

        complete_iterations("ckpt")   # [100, 200] for ckpt/iter_0000100, ckpt/iter_0000200, ckpt/iter_0000300.tmp-1f
    """
    if not os.path.isdir(root):
        return []
    found = (_COMPLETE.fullmatch(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def rng_file(rank: int) -> str:
    """Our trainer's RNG state of ``rank``, relative to an iteration directory."""
    return os.path.join("rng", f"rank_{rank:05d}.pt")


# ----------------------------------------------------------------------------------------------------------
# The tracker
# ----------------------------------------------------------------------------------------------------------


class CheckpointMismatch(UserError, ValueError):
    """A Megatron checkpoint does not hold what its model needs (architecture, tensor names or shapes), or its
    description is damaged."""


def read_tracker(root: str) -> int | str | None:
    """The iteration in ``latest_checkpointed_iteration.txt``, ``"release"`` for a converted checkpoint, or
    None when there is no checkpoint."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise CheckpointMismatch(f"{path} holds {text!r}; expected an iteration number or {RELEASE!r}")
    return int(text)


def no_checkpoint_notice(root: str) -> str:
    """What a run given ``--load root`` with no checkpoint there logs before it starts from random weights, as
    Megatron-LM does ("could not find the metadata file ... will start from random"): the first run of a job that
    saves and loads one directory. (A Hugging Face model directory is refused before launch: arguments.py.)

    Example::

        logger.warning(no_checkpoint_notice("ckpt"))   # --load ckpt: no checkpoint there (...), so the model ...
    """
    return f"--load {root}: no checkpoint there (no {TRACKER_FILE}), so the model starts from random weights"


def write_tracker(root: str, iteration: int | str) -> None:
    """Replace the tracker atomically: a reader (or a restart after a crash) sees the old or the new iteration,
    never an empty file.

    Example::

        write_tracker("ckpt", 4)    # resume from ckpt/iter_0000004
    """
    path = os.path.join(root, TRACKER_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_path(root)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (both can be opened read-only for it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def weights_dir(megatron_dir: str) -> str:
    """The iteration directory the tracker file points at (``release`` or ``iter_0000100``)."""
    tag = read_tracker(megatron_dir)
    if tag is None:
        raise FileNotFoundError(f"{megatron_dir} has no {TRACKER_FILE}")
    return os.path.join(megatron_dir, RELEASE) if tag == RELEASE else checkpoint_dir(megatron_dir, tag)


def checkpoint_format(weights: str) -> str | None:
    """"torch_dist" (megatron-core's metadata.json, with a common.pt from megatron-core 0.16.1, with DCP's .metadata
    from 0.19: ``compat.common_state_source``), "torch" (Megatron-LM's per-rank ``mp_rank_*/model_optim_rng.pt``)
    or None, from the files in an iteration directory."""
    if os.path.isfile(compat.common_state_source(weights)) and os.path.isfile(os.path.join(weights, "metadata.json")):
        return "torch_dist"
    if glob.glob(os.path.join(weights, "mp_rank_00*", "model_optim_rng.pt")):
        return "torch"
    return None


# ----------------------------------------------------------------------------------------------------------
# The description: megatron_patch_args.json, or Megatron-LM's args
# ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CheckpointInfo:
    """What ``megatron_patch_args.json`` records next to the weights, so no model flag has to be repeated."""

    format: str
    model_config: ModelConfig
    padded_vocab_size: int
    dtype: str = "float32"
    """The dtype of the stored weights (the Hugging Face checkpoint's), a name in :data:`DTYPES`."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    hf_config: dict | None = None
    hf_architecture: str | None = None
    initialized_tensors: list[str] = dataclasses.field(default_factory=list)
    """megatron tensors the Hugging Face checkpoint did not have (heads of an encoder-only BERT)."""
    tokenizer_files: list[str] = dataclasses.field(default_factory=list)
    vocab_size_known: bool = True
    """False for a Megatron-LM save of a run without --vocab-size (a tokenizer from its files): its args record the
    embedding's padded rows only, which ``model_config.vocab_size`` then holds, and any tokenizer that pads to them
    is the run's (Megatron-LM resumes with it)."""

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["model_config"] = dataclasses.asdict(self.model_config)
        if self.vocab_size_known:  # the file stays as it was before the field, which older releases can read
            del data["vocab_size_known"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "CheckpointInfo":
        return cls(**{**data, "model_config": ModelConfig(**data["model_config"])})


def write_args_file(megatron_dir: str, info: CheckpointInfo) -> None:
    """Write ``megatron_patch_args.json`` under a temporary name, then rename it: a reader never sees half a file
    (the trainer rewrites it at every save of a directory that may be being exported).

    Example::

        write_args_file("ckpt", CheckpointInfo("torch_dist", get_model_config("tiny-llama"), 128))
    """
    path = os.path.join(megatron_dir, ARGS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(info.to_json(), f, indent=2)
    os.replace(path + ".tmp", path)


def write_info(megatron_dir: str, info: CheckpointInfo) -> None:
    """The description and a tracker naming ``release``: a converted checkpoint's."""
    write_args_file(megatron_dir, info)
    write_tracker(megatron_dir, RELEASE)


def read_info(megatron_dir: str) -> CheckpointInfo:
    """The description of ``megatron_dir``'s checkpoint: its ``megatron_patch_args.json`` or, without one (a
    checkpoint Megatron-LM's ``save_checkpoint`` wrote), the Megatron-LM ``args`` stored with its weights.

    Example::

        read_info("llama-mcore").model_config.hidden_size     # 4096
    """
    found = find_info(megatron_dir)
    if found is None:
        raise FileNotFoundError(
            f"{megatron_dir} has neither {ARGS_FILE} nor a Megatron-LM checkpoint ({TRACKER_FILE} naming a directory "
            "with common.pt or mp_rank_*/model_optim_rng.pt); pass a directory written by `megatron-patch convert "
            "hf-to-megatron`, by our trainer or by Megatron-LM"
        )
    return found[0]


def find_info(megatron_dir: str) -> tuple[CheckpointInfo, str] | None:
    """``(description, the file it was read from)`` of a Megatron checkpoint, or None when ``megatron_dir`` holds
    none (nothing saved yet, or a plain/Hugging Face model's trainer checkpoint).

    Example::

        info, source = find_info("megatron-lm-run")
        source                           # "megatron-lm-run/iter_0000100/mp_rank_00/model_optim_rng.pt"
    """
    path = os.path.join(megatron_dir, ARGS_FILE)
    if os.path.isfile(path):
        return _read_args_file(path), path
    if not os.path.isfile(os.path.join(megatron_dir, TRACKER_FILE)):
        return None
    weights = weights_dir(megatron_dir)
    fmt = checkpoint_format(weights)
    if fmt is None:
        return None
    source = _args_source(weights, fmt)
    return info_from_megatron_lm(read_args_state(source), fmt, source), source


def _args_source(weights: str, fmt: str) -> str:
    """The file of an iteration directory that holds Megatron-LM's ``args``: its common state (torch_dist:
    ``compat.common_state_source``), else the first rank file (every rank file carries the same args; the first one
    is there at any TP/PP)."""
    if fmt == "torch_dist":
        return compat.common_state_source(weights)
    return sorted(glob.glob(os.path.join(weights, "mp_rank_00*", "model_optim_rng.pt")))[0]


def read_args_state(source: str) -> dict:
    """The state dict holding Megatron-LM's ``args`` that ``source`` (``_args_source``) names: a common.pt or a rank
    file, memory-mapped (``load_megatron_file``), or the "common_state" object of the .distcp files that DCP's
    .metadata indexes (``compat.load_common_state_object``).

    Example::

        read_args_state("ckpt/iter_0000100/common.pt")["args"].hidden_size    # 4096
    """
    if os.path.basename(source) == compat.DCP_METADATA_FILE:
        return compat.load_common_state_object(os.path.dirname(source))
    return load_megatron_file(source, mapped=True)


def recorded_train_samples(weights: str) -> tuple[int, int] | None:
    """``(consumed_train_samples, skipped_train_samples)`` as the Megatron-LM ``args`` of the iteration directory
    ``weights`` record them (ours and Megatron-LM's saves write them); None when it has no args or they count
    nothing (a plain model's save, or a Megatron-LM run older than these fields).

    Example::

        recorded_train_samples("ckpt/iter_0000100")    # (1520, 0): a ramp-up took fewer samples than 100 x 16

    Megatron-LM's ``load_checkpoint`` resumes its data and batch ramp-up from these
    (megatron/training/checkpointing.py at core_v0.16.1), not from the iteration: after a ramp-up or a change of
    --global-batch-size the iteration does not tell them.
    """
    fmt = checkpoint_format(weights)
    if fmt is None:
        return None
    args = read_args_state(_args_source(weights, fmt)).get("args")
    consumed = getattr(args, "consumed_train_samples", None)
    if not consumed:  # Megatron-LM too counts a 0 at a later iteration as unrecorded (its backward compatibility)
        return None
    return consumed, getattr(args, "skipped_train_samples", None) or 0


def _read_args_file(path: str) -> CheckpointInfo:
    # Only a conversion or a trainer's save writes it (write_args_file): restoring it is the fix.
    fix = f"restore {ARGS_FILE} from a copy, or re-run the conversion or training that wrote the checkpoint"
    data = read_json(path, fix)
    try:
        return CheckpointInfo.from_json(data)
    except (TypeError, KeyError, ValueError) as error:  # a JSON of another shape, fields unknown or missing
        raise CheckpointMismatch(f"{path}: not a description of a checkpoint ({type(error).__name__}: {error}); "
                                 f"{fix}") from None


def load_megatron_file(path: str, *, mapped: bool = False) -> dict:
    """A legacy rank file (``mp_rank_*/model_optim_rng.pt``) or torch_dist's common.pt, unpickled with
    ``weights_only=True``: besides tensors only the types megatron-core registers as safe
    (megatron/core/safe_globals.py: Megatron-LM's ``args`` Namespace, its enums, numpy's RNG state in
    ``rng_state``). Registered again here, not through torch's ``safe_globals`` context manager: on exit that
    unregisters what it was given, megatron-core's registrations included (its import registers them once), and
    megatron-core's own ``dist_checkpointing.load`` of a common.pt then fails. A pickle that would call anything
    else is refused, naming the file and the call (``unpickle.unsafe_pickle``).

    Example::

        load_megatron_file("ckpt/iter_0000100/mp_rank_00/model_optim_rng.pt")["args"].hidden_size    # 4096

    ``mapped``: the file is memory-mapped instead of read, so its tensors cost no memory or reading until they are
    touched. For the args and the tensors' names alone: a Megatron-LM rank file holds a shard of the model and, saved
    with its optimizer, three times as much again, all of which a plain read loads into memory. torch maps only its
    zip format (``torch.save``'s since torch 1.6); a file of the older format is read.
    """
    import torch
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    try:
        mapped = mapped and zipfile.is_zipfile(path)  # a truncated zip is read, and its error named, as before
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError:
        from megatron_patch.unpickle import unsafe_pickle  # here: it imports torch

        raise unsafe_pickle(path) from None
    except RuntimeError as error:  # torch.load's reader on a truncated or overwritten zip
        raise CheckpointMismatch(f"{path} does not load ({str(error).split('. ')[0]}): it is truncated or damaged; "
                                 "copy it again from the run that saved it") from None


# Megatron-LM args (name, value that cannot be built) our model refuses: each is an architecture ModelConfig has
# no field for, so loading the weights into our model would silently drop or misplace them.
_UNSUPPORTED_ARGS = {
    "is_hybrid_model": "Mamba/hybrid layers",
    "hybrid_override_pattern": "Mamba/hybrid layers",
    "heterogeneous_layers_config_path": "heterogeneous layers",
    "heterogeneous_layers_config_encoded_json": "heterogeneous layers",
    "squared_relu": "the squared-ReLU activation",
    "rotary_interleaved": "interleaved RoPE",
    "mtp_num_layers": "multi-token-prediction layers",
}

# Megatron-LM's MoE args (name, the value our MoE layer computes) that change what a MoE model computes and which
# ModelConfig does not carry: any other value is refused by name.
_MOE_FIXED_ARGS = {"moe_latent_size": None}


def _settings_from_megatron_lm(args: argparse.Namespace, source: str) -> dict:
    """ModelConfig's fields that Megatron-LM's ``args`` hold as they are (model/config.py's ``Setting.megatron_lm``),
    a feature's only in a model that has it; a value outside a field's choices is refused by name."""
    on = {None: True, "moe": bool(getattr(args, "num_experts", None)),
          "mla": bool(getattr(args, "multi_latent_attention", None))}
    values = {}
    for s in SETTINGS.values():
        if not s.megatron_lm or not on[s.feature]:
            continue
        given = [v for v in (getattr(args, name, None) for name in s.megatron_lm) if v is not None]
        if not given and s.megatron_lm_default is dataclasses.MISSING:
            raise AttributeError(name=s.megatron_lm[0], obj=args)
        value = given[0] if given else s.megatron_lm_default
        if s.options.get("type") in (int, float) and value is not None:
            value = s.options["type"](value)
        _check_choice(source, s.megatron_lm[0], value, s.options.get("choices"))
        values[s.name] = value
    return values


def _settings_as_megatron_lm(m: ModelConfig) -> dict:
    """Megatron-LM's args of the fields :func:`_settings_from_megatron_lm` reads (None for a feature ``m`` lacks,
    which leaves Megatron-LM's own flags in charge)."""
    return {name: getattr(m, s.name) if m.uses(s.feature) else None
            for s in SETTINGS.values() for name in s.megatron_lm}


def _check_choice(source: str, name: str, value, allowed) -> None:
    if allowed is not None and value not in allowed:
        raise CheckpointMismatch(f"{source}: args.{name}={value!r} is not supported by our model (one of "
                                 f"{', '.join(allowed)})")


def _check_moe_args(arg, source: str, fmt: str) -> None:
    """Refuse a mixture-of-experts checkpoint our model would read wrong."""
    if not arg("num_experts"):
        return
    if fmt == "torch":  # expert ranks are in the rank files' names (mp_rank_TT_EEE), which checkpoint.legacy lacks
        raise CheckpointMismatch(f"{source}: per-rank files of a mixture-of-experts model are not read; save it as "
                                 "torch_dist (--ckpt-format torch_dist) first")
    for name, value in _MOE_FIXED_ARGS.items():
        given = arg(name, value)
        if given != value:
            raise CheckpointMismatch(f"{source}: args.{name}={given!r} is not supported by our MoE layer (only "
                                     f"{value!r})")


# Tokens a Megatron-LM tokenizer adds after the --vocab-size ids it is built from: its NullTokenizer's eod is id
# vocab_size, so it has vocab_size + 1 tokens (_NullTokenizer in megatron/training/tokenizer/tokenizer.py at
# core_v0.16.1), while args.vocab_size keeps the flag as given. ModelConfig.vocab_size counts the tokenizer's tokens.
_TOKENS_AFTER_VOCAB_SIZE = {"NullTokenizer": 1}


def info_from_megatron_lm(state: dict, fmt: str, source: str) -> CheckpointInfo:
    """Our description of a checkpoint from the ``args`` Megatron-LM stores in it (``state``: common.pt's or a
    rank file's contents), read as its ``--use-checkpoint-args`` reads them (load_args_from_checkpoint in
    megatron/training/checkpointing.py at core_v0.16.1). Refuses, naming the field, what our model cannot build.

    Example::

        info_from_megatron_lm(torch.load("ckpt/iter_0000100/common.pt"), "torch_dist", "ckpt/iter_0000100/common.pt")

    Megatron-LM's args do not say which model script trained them (every run's args hold pretrain_bert.py's
    ``bert_binary_head``, True by default); its tensors do. megatron-core's ``BertModel`` (pretrain_bert.py) names
    its layers ``encoder.layers.*``, its ``GPTModel`` ``decoder.layers.*``: an encoder is our pre-LN BERT (the
    layer spec Megatron-LM trains BERT with normalises before each sublayer), with pretrain_bert.py's heads and
    token types (``num_tokentypes = 2 if args.bert_binary_head else 0``).
    """
    args = state.get("args")
    if not isinstance(args, argparse.Namespace):
        raise CheckpointMismatch(f"{source} has no Megatron-LM args (saved without them?); re-save it with "
                                 f"Megatron-LM's save_checkpoint or convert it with `megatron-patch convert`")
    version = state.get("checkpoint_version", 0)
    if version < 3.0:  # older versions order q/k/v differently (fix_query_key_value_ordering) and name TP otherwise
        raise CheckpointMismatch(f"{source}: checkpoint_version {version}; only 3.0 is read: load and re-save it "
                                 "with a current Megatron-LM first")

    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    for name, what in _UNSUPPORTED_ARGS.items():
        if arg(name):
            raise CheckpointMismatch(f"{source}: args.{name}={arg(name)!r} ({what}) is not supported by our model; "
                                     "only GPT (dense or MoE) and BERT checkpoints are read")
    if fmt == "torch" and arg("virtual_pipeline_model_parallel_size"):
        raise CheckpointMismatch(f"{source}: args.virtual_pipeline_model_parallel_size="
                                 f"{arg('virtual_pipeline_model_parallel_size')}: per-rank files of an interleaved "
                                 "pipeline are not read; save it as torch_dist (--ckpt-format torch_dist) first")
    _check_moe_args(arg, source, fmt)
    try:
        settings = _settings_from_megatron_lm(args, source)
    except AttributeError as error:  # one of the shape fields every Megatron-LM run has
        raise CheckpointMismatch(f"{source}: args lack {error.name}; not a Megatron-LM GPT or BERT checkpoint"
                                 ) from None
    activation = "swiglu" if arg("swiglu") else "gelu_tanh" if arg("openai_gelu") else "gelu"
    # Older Megatron-LM args have only use_rotary_position_embeddings.
    position = arg("position_embedding_type", "rope" if arg("use_rotary_position_embeddings") else "learned_absolute")
    _check_choice(source, "position_embedding_type", position, ("learned_absolute", "rope"))
    shapes = _tensor_shapes(state, fmt, source)
    # The rows of the stored embedding, which args.padded_vocab_size records; Megatron-LM's args keep the
    # tokenizer's own size only through --vocab-size (None without it), so the padded rows are the vocabulary then.
    padded = arg("padded_vocab_size") or _embedding_rows(shapes, arg("tensor_model_parallel_size", 1), fmt)
    if padded is None:
        raise CheckpointMismatch(f"{source}: args.padded_vocab_size is missing and no embedding.word_embeddings.weight "
                                 "is stored; the vocabulary is unknown")
    vocab = arg("vocab_size")
    if vocab is not None:
        vocab += _TOKENS_AFTER_VOCAB_SIZE.get(arg("tokenizer_type"), 0)
    bert = any(name.startswith("encoder.") for name in shapes)
    binary_head = bool(bert and arg("bert_binary_head", True))
    token_types = arg("num_tokentypes", 2 if binary_head else 0) if bert else 0
    try:
        model_config = ModelConfig(
            **settings, family="bert" if bert else "gpt",
            num_tokentypes=token_types, add_binary_head=binary_head, bert_layernorm_style="pre",
            num_query_groups=arg("num_query_groups") if arg("group_query_attention") else None,
            max_position_embeddings=arg("max_position_embeddings"), position_embedding_type=position,
            activation=activation, vocab_size=vocab or padded,
        )
    except ValueError as error:
        raise CheckpointMismatch(f"{source}: its args describe no model: {error}") from None
    return CheckpointInfo(
        format=fmt, model_config=model_config, padded_vocab_size=padded, vocab_size_known=vocab is not None,
        dtype="bfloat16" if arg("bf16") else "float16" if arg("fp16") else "float32",
        tensor_model_parallel_size=arg("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=arg("pipeline_model_parallel_size", 1),
    )


def _tensor_shapes(state: dict, fmt: str, source: str) -> dict[str, tuple[int, ...]]:
    """The stored tensors' names and shapes: a rank file's own (``state["model"]``, one TP x PP shard), or the
    global shapes of torch_dist's metadata beside ``source`` (its common state: ``_args_source``)."""
    if fmt == "torch":
        return {name: tuple(t.shape) for name, t in state.get("model", {}).items() if hasattr(t, "shape")}
    if not os.path.isfile(os.path.join(os.path.dirname(source), "metadata.json")):
        return {}  # a common.pt read on its own: its args alone describe the model
    from megatron.core import dist_checkpointing

    return {name: tuple(t.global_shape) for name, t in
            dist_checkpointing.load_tensors_metadata(os.path.dirname(source)).items() if hasattr(t, "global_shape")}


def _embedding_rows(shapes: dict[str, tuple[int, ...]], tensor_parallel: int, fmt: str) -> int | None:
    """The word embedding's rows over all TP ranks (a rank file holds 1/TP of them: megatron-core's
    VocabParallelEmbedding splits the vocabulary evenly); None where the first file holds no embedding."""
    rows = shapes.get("embedding.word_embeddings.weight", (None,))[0]
    return rows * tensor_parallel if rows is not None and fmt == "torch" else rows


def megatron_lm_args(info: CheckpointInfo, **training) -> argparse.Namespace:
    """Megatron-LM's ``args`` for a checkpoint of ``info``'s model: every field its ``load_args_from_checkpoint``
    and ``load_checkpoint`` read (megatron/training/checkpointing.py at core_v0.16.1), under its names, so
    ``--use-checkpoint-args`` rebuilds the model and a resume continues at the right sample.

    Example::

        megatron_lm_args(info, iteration=10, consumed_train_samples=80, tokenizer_type="GPT2BPETokenizer")

    ``training`` overrides what only a trainer knows (consumed samples, the tokenizer, virtual pipeline size);
    ``vocab_size`` is then Megatron-LM's ``--vocab-size`` for that tokenizer (a NullTokenizer's, one less than the
    model's vocabulary: its eod comes after), as :func:`info_from_megatron_lm` reads it back.
    The Mamba and hybrid fields are None (Megatron-LM keeps its own flags for them); the MoE fields are the model's.
    """
    m = info.model_config
    vocab = m.vocab_size or (info.hf_config or {}).get("vocab_size")
    if vocab is not None:
        vocab -= _TOKENS_AFTER_VOCAB_SIZE.get(training.get("tokenizer_type"), 0)
    fields = dict(
        _settings_as_megatron_lm(m), num_query_groups=m.num_query_groups,
        group_query_attention=m.num_query_groups != m.num_attention_heads, max_position_embeddings=m.max_positions,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=m.position_embedding_type == "rope", rotary_interleaved=False,
        squared_relu=False, swiglu=m.activation == "swiglu", openai_gelu=m.activation == "gelu_tanh",
        apply_query_key_layer_scaling=False, hybrid_override_pattern=None, spec=None, hybrid_attention_ratio=None,
        hybrid_mlp_ratio=None, moe_token_dispatcher_type=None, moe_grouped_gemm=None,
        **{name: value if m.uses("moe") else None for name, value in _MOE_FIXED_ARGS.items()},
        mamba_state_dim=None, mamba_head_dim=None, mamba_num_groups=None, mamba_num_heads=None,
        is_hybrid_model=False, heterogeneous_layers_config_path=None,
        heterogeneous_layers_config_encoded_json=None,
        # A conversion's tokenizer is the Hugging Face one saved in hf_tokenizer/ (Megatron-LM's
        # HuggingFaceTokenizer); the path is left to the reader's --tokenizer-model, the directory may move.
        tokenizer_type="HuggingFaceTokenizer" if info.tokenizer_files else None, tokenizer_model=None,
        tiktoken_pattern=None, padded_vocab_size=info.padded_vocab_size, vocab_size=vocab, ckpt_format=info.format,
        fp16=info.dtype == "float16", bf16=info.dtype == "bfloat16",
        tensor_model_parallel_size=info.tensor_model_parallel_size,
        pipeline_model_parallel_size=info.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        expert_model_parallel_size=1, consumed_train_samples=0, skipped_train_samples=0,
        consumed_valid_samples=0, num_tokentypes=m.num_tokentypes, bert_binary_head=m.add_binary_head,
        megatron_patch=json.dumps(info.to_json()),
    )
    return argparse.Namespace(**{**fields, **training})


def megatron_lm_common_state(info: CheckpointInfo, iteration: int, **training) -> dict:
    """The non-tensor part of a Megatron-LM checkpoint (its ``generate_state_dict``): ``args``,
    ``checkpoint_version`` 3.0 (Megatron-LM's current one: TP/PP sizes under their own names) and ``iteration``.

    Example::

        torch.save({"model": shards, **megatron_lm_common_state(info, 0)}, "release/mp_rank_00/model_optim_rng.pt")
    """
    return {"args": megatron_lm_args(info, **training), "checkpoint_version": 3.0, "iteration": iteration}


# ----------------------------------------------------------------------------------------------------------
# Tensors by name
# ----------------------------------------------------------------------------------------------------------


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """A TP=1, PP=1 model's tensors by megatron-core name (no ``_extra_state``)."""
    import torch

    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def partition_dims(model) -> dict[str, int | None]:
    """Tensor-parallel split dimension per tensor name with ``{}`` for the layer (None: replicated), from
    megatron's parameter attributes; the same at every layout."""
    dims = {}
    for name, param in model.named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        dims[LAYER.sub(r"\1{}.", name)] = param.partition_dim if split else None
    return dims
