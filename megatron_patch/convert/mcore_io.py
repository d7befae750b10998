"""Megatron checkpoint directories: megatron-core ``torch_dist`` and Megatron-LM's legacy per-rank ``torch`` format.

Example::

    info = read_info("ckpt")                          # megatron_patch_args.json, else Megatron-LM's own args
    model = build_reference_model(info.model_config, info.padded_vocab_size)
    load_into_reference_model(model, "ckpt", info)    # either format, any TP/PP it was written at
    full = full_state_dict(model)                     # megatron-core names -> unsharded tensors

Layout of a directory (Megatron-LM's, so its ``--load`` finds the weights)::

    latest_checkpointed_iteration.txt                 "release"
    megatron_patch_args.json                          ModelConfig, padded vocabulary, HF config, format
    release/                                          torch_dist: metadata.json, *.distcp, common.pt with ``args``
    release/mp_rank_TT[_PPP]/model_optim_rng.pt       torch: one file per TP (x PP) rank, with ``args``
    hf_tokenizer/                                     the tokenizer files given at conversion

A checkpoint Megatron-LM's own ``save_checkpoint`` wrote has no ``megatron_patch_args.json`` (nor ``release``: its
tracker holds the iteration of an ``iter_0000100/``); :func:`read_info` then takes the model from the ``args`` in its
common.pt or ``mp_rank_00*/model_optim_rng.pt`` (:func:`info_from_megatron_lm`), the format from the files present.

The ``torch_dist`` checkpoint is written from full (TP=1, PP=1) tensors under megatron-core's sharded keys, one
tensor at a time (:func:`stream_dist`), so ``dist_checkpointing.load(model.sharded_state_dict(), dir)`` reshards
it to any layout on load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import glob
import os
import pickle
import re
from typing import Callable

import torch

from megatron_patch.convert.families import first_problems
from megatron_patch.convert.hf_io import read_json
from megatron_patch.distributed import free_port
from megatron_patch.errors import UserError
from megatron_patch.model.config import ModelConfig

ARGS_FILE = "megatron_patch_args.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
TOKENIZER_DIR = "hf_tokenizer"
_LAYER = re.compile(r"^((?:decoder|encoder)\.layers\.)(\d+)\.")


class CheckpointMismatch(UserError, ValueError):
    """A Megatron checkpoint does not hold what its model needs (architecture, tensor names or shapes), or its
    description is damaged."""


@dataclasses.dataclass
class CheckpointInfo:
    """What ``megatron_patch_args.json`` records next to the weights, so no model flag has to be repeated."""

    format: str
    model_config: ModelConfig
    padded_vocab_size: int
    dtype: str = "float32"
    """The dtype of the stored weights (the Hugging Face checkpoint's)."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    hf_config: dict | None = None
    hf_architecture: str | None = None
    initialized_tensors: list[str] = dataclasses.field(default_factory=list)
    """megatron tensors the Hugging Face checkpoint did not have (heads of an encoder-only BERT)."""
    tokenizer_files: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["model_config"] = dataclasses.asdict(self.model_config)
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
    write_args_file(megatron_dir, info)
    with open(os.path.join(megatron_dir, TRACKER_FILE), "w") as f:
        f.write(RELEASE)


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
    # Every rank file carries the same args; the first one is there at any TP/PP.
    source = (os.path.join(weights, "common.pt") if fmt == "torch_dist"
              else sorted(glob.glob(os.path.join(weights, "mp_rank_00*", "model_optim_rng.pt")))[0])
    return info_from_megatron_lm(load_legacy_file(source), fmt, source), source


def _read_args_file(path: str) -> CheckpointInfo:
    # Only a conversion or a trainer's save writes it (write_args_file): restoring it is the fix.
    fix = f"restore {ARGS_FILE} from a copy, or re-run the conversion or training that wrote the checkpoint"
    data = read_json(path, fix)
    try:
        return CheckpointInfo.from_json(data)
    except (TypeError, KeyError, ValueError) as error:  # a JSON of another shape, fields unknown or missing
        raise CheckpointMismatch(f"{path}: not a description of a checkpoint ({type(error).__name__}: {error}); "
                                 f"{fix}") from None


def checkpoint_format(weights: str) -> str | None:
    """"torch_dist" (megatron-core's common.pt and metadata.json), "torch" (Megatron-LM's per-rank
    ``mp_rank_*/model_optim_rng.pt``) or None, from the files in an iteration directory."""
    if os.path.isfile(os.path.join(weights, "common.pt")) and os.path.isfile(os.path.join(weights, "metadata.json")):
        return "torch_dist"
    if glob.glob(os.path.join(weights, "mp_rank_00*", "model_optim_rng.pt")):
        return "torch"
    return None


# Megatron-LM args (name, value that cannot be built) our model refuses: each is an architecture ModelConfig has
# no field for, so loading the weights into our model would silently drop or misplace them.
_UNSUPPORTED_ARGS = {
    "num_experts": "mixture-of-experts layers",
    "is_hybrid_model": "Mamba/hybrid layers",
    "hybrid_override_pattern": "Mamba/hybrid layers",
    "heterogeneous_layers_config_path": "heterogeneous layers",
    "heterogeneous_layers_config_encoded_json": "heterogeneous layers",
    "multi_latent_attention": "multi-latent attention",
    "qk_layernorm": "layer norms on queries and keys",
    "squared_relu": "the squared-ReLU activation",
    "rotary_interleaved": "interleaved RoPE",
    "mtp_num_layers": "multi-token-prediction layers",
}


def info_from_megatron_lm(state: dict, fmt: str, source: str) -> CheckpointInfo:
    """Our description of a checkpoint from the ``args`` Megatron-LM stores in it (``state``: common.pt's or a
    rank file's contents), read as its ``--use-checkpoint-args`` reads them (load_args_from_checkpoint in
    megatron/training/checkpointing.py at core_v0.16.1). Refuses, naming the field, what our model cannot build.

    Example::

        info_from_megatron_lm(torch.load("ckpt/iter_0000100/common.pt"), "torch_dist", "ckpt/iter_0000100/common.pt")

    The family is GPT: Megatron-LM's args do not say which model script trained them.
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
                                     "only dense GPT checkpoints are read")
    if fmt == "torch" and arg("virtual_pipeline_model_parallel_size"):
        raise CheckpointMismatch(f"{source}: args.virtual_pipeline_model_parallel_size="
                                 f"{arg('virtual_pipeline_model_parallel_size')}: per-rank files of an interleaved "
                                 "pipeline are not read; save it as torch_dist (--ckpt-format torch_dist) first")
    activation = "swiglu" if arg("swiglu") else "gelu_tanh" if arg("openai_gelu") else "gelu"
    # Older Megatron-LM args have only use_rotary_position_embeddings.
    position = arg("position_embedding_type", "rope" if arg("use_rotary_position_embeddings") else "learned_absolute")
    choices = {"position_embedding_type": (position, ("learned_absolute", "rope")),
               "normalization": (arg("normalization", "LayerNorm"), ("LayerNorm", "RMSNorm"))}
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise CheckpointMismatch(f"{source}: args.{name}={value!r} is not supported by our model (one of "
                                     f"{', '.join(allowed)})")
    padded = arg("padded_vocab_size")
    if padded is None:
        raise CheckpointMismatch(f"{source}: args.padded_vocab_size is missing; the embedding's size is unknown")
    try:
        model_config = ModelConfig(
            family="gpt", num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
            ffn_hidden_size=arg("ffn_hidden_size"),
            num_query_groups=arg("num_query_groups") if arg("group_query_attention") else None,
            kv_channels=arg("kv_channels"), max_position_embeddings=arg("max_position_embeddings"),
            position_embedding_type=position, rotary_base=int(arg("rotary_base", 10000)),
            rotary_percent=float(arg("rotary_percent", 1.0)), normalization=choices["normalization"][0],
            # --norm-epsilon's dest; checkpoints of older Megatron-LM have only layernorm_epsilon.
            layernorm_epsilon=arg("norm_epsilon", arg("layernorm_epsilon", 1e-5)), activation=activation,
            add_bias_linear=arg("add_bias_linear", True), add_qkv_bias=arg("add_qkv_bias", False),
            untie_embeddings_and_output_weights=arg("untie_embeddings_and_output_weights", False),
            vocab_size=arg("vocab_size", padded), make_vocab_size_divisible_by=arg("make_vocab_size_divisible_by", 128),
            hidden_dropout=arg("hidden_dropout", 0.1), attention_dropout=arg("attention_dropout", 0.1),
            init_method_std=arg("init_method_std", 0.02),
            layernorm_zero_centered_gamma=arg("apply_layernorm_1p", False),
        )
    except AttributeError as error:  # one of the shape fields every Megatron-LM run has
        raise CheckpointMismatch(f"{source}: args lack {error.name}; not a Megatron-LM GPT checkpoint") from None
    except ValueError as error:
        raise CheckpointMismatch(f"{source}: its args describe no model: {error}") from None
    return CheckpointInfo(
        format=fmt, model_config=model_config, padded_vocab_size=padded,
        dtype="bfloat16" if arg("bf16") else "float16" if arg("fp16") else "float32",
        tensor_model_parallel_size=arg("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=arg("pipeline_model_parallel_size", 1),
    )


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


def weights_dir(megatron_dir: str) -> str:
    """The iteration directory the tracker file points at (``release`` or ``iter_0000100``)."""
    tag = read_tracker(megatron_dir)
    if tag is None:
        raise FileNotFoundError(f"{megatron_dir} has no {TRACKER_FILE}")
    return os.path.join(megatron_dir, RELEASE if tag == RELEASE else f"iter_{tag:07d}")


# ----------------------------------------------------------------------------------------------------------
# The reference (TP=1, PP=1) model that full tensors live in
# ----------------------------------------------------------------------------------------------------------


def build_reference_model(model_config: ModelConfig, padded_vocab_size: int, dtype: torch.dtype = torch.float32,
                          allocate_only: bool = False, meta: bool = False):
    """megatron-core's model at TP=1, PP=1 in this process (a world of one rank).

    ``allocate_only`` skips the random initialisation of a model whose every tensor is about to be overwritten
    (it is built on the meta device, then given uninitialised memory): seconds saved per billion parameters.
    ``meta`` leaves it on the meta device: names, shapes and sharding without memory (for :func:`stream_dist`).
    """
    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.parallel import ParallelConfig

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=1234)
    parallel = ParallelConfig(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    if not (allocate_only or meta):
        [model] = build_model_chunks(model_config, parallel, padded_vocab_size)
        return model
    with torch.device("meta"):
        [model] = build_model_chunks(model_config, parallel, padded_vocab_size)
    if meta:
        return model
    # to_empty makes new Parameters; megatron's attributes on them (partition_dim, shared, ...) must survive.
    attributes = {name: dict(vars(param)) for name, param in model.named_parameters()}
    model.to_empty(device="cpu")
    for name, param in model.named_parameters():
        vars(param).update(attributes[name])
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The reference model's tensors by megatron-core name (no ``_extra_state``)."""
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def partition_dims(model) -> dict[str, int | None]:
    """Tensor-parallel split dimension per tensor name with ``{}`` for the layer (None: replicated), from
    megatron's parameter attributes; the same at every layout."""
    dims = {}
    for name, param in model.named_parameters():
        dims[_LAYER.sub(r"\1{}.", name)] = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
    return dims


def _is_gated_fc1(name: str, model_config: ModelConfig) -> bool:
    return model_config.activation == "swiglu" and re.search(r"\.mlp\.linear_fc1\.(weight|bias)$", name) is not None


# ----------------------------------------------------------------------------------------------------------
# torch_dist (megatron-core dist_checkpointing)
# ----------------------------------------------------------------------------------------------------------


def _sharded_tensors(sharded_state_dict, prefix=""):
    """(state-dict name, ShardedTensor) pairs, factories built (the swiglu fc1 factory yields two)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for name, value in sharded_state_dict.items():
        if isinstance(value, dict):
            yield from _sharded_tensors(value, f"{prefix}{name}.")
        elif isinstance(value, ShardedTensorFactory):
            built = value.build()
            for sharded in built.values() if isinstance(built, dict) else built:
                yield prefix + name, sharded
        elif isinstance(value, ShardedTensor):
            yield prefix + name, value


def check_dist_checkpoint(model, ckpt_dir: str) -> None:
    """Raise CheckpointMismatch naming each tensor the model needs that the checkpoint lacks or holds with
    another global shape (a checkpoint of another architecture), before megatron-core's own less direct errors."""
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    problems = []
    for _, sharded in _sharded_tensors(model.sharded_state_dict()):
        if sharded.key not in stored:
            problems.append(f"{sharded.key}: missing from the checkpoint (model expects {tuple(sharded.global_shape)})")
        elif tuple(stored[sharded.key].global_shape) != tuple(sharded.global_shape):
            problems.append(f"{sharded.key}: checkpoint has shape {tuple(stored[sharded.key].global_shape)}, "
                            f"model expects {tuple(sharded.global_shape)}")
    if problems:
        raise CheckpointMismatch(f"{ckpt_dir} does not fit the model its description ({ARGS_FILE} or Megatron-LM "
                                 "args) records: "
                                 f"{first_problems(sorted(set(problems)))}")


def save_dist(model, ckpt_dir: str, info: CheckpointInfo) -> None:
    """Write ``model`` as a torch_dist checkpoint with Megatron-LM's common state (:func:`megatron_lm_common_state`)."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save({**megatron_lm_common_state(info, 0), **model.sharded_state_dict()}, ckpt_dir)


def stream_dist(model, ckpt_dir: str, materialise: Callable[[str], torch.Tensor], info: CheckpointInfo) -> None:
    """Write a torch_dist checkpoint of ``model`` (a meta-device reference model: it only lends names, shapes
    and megatron-core's sharding) whose tensors come from ``materialise(name)``, one at a time.

    Example::

        stream_dist(build_reference_model(config, padded, meta=True), "out/release",
                    lambda name: read_and_transform(name), info)  # full (TP=1) tensor by megatron-core name

    megatron-core's own ``dist_checkpointing.save`` writes metadata.json, common.pt (the state dict's non-tensor
    entries: Megatron-LM's ``args``, from ``info``) and the DCP metadata; only
    the tensor writing is replaced: synchronously, by PyTorch DCP's ``FileSystemWriter`` with one thread (its data
    file written around the page cache, :mod:`megatron_patch.convert.direct_io`), whose planner asks for each
    tensor as the file reaches it. So one tensor group is in memory at a time (megatron's
    default strategy holds all of them and copies them to writer processes), and the files are those of its
    torch_dist format, which ``dist_checkpointing.load`` reshards to any TP/PP.
    """
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    sharded_state = model.sharded_state_dict()
    sources = {(sharded.key, tuple(sharded.global_offset)): _full_index(name, sharded)
               for name, sharded in _sharded_tensors(sharded_state)}
    dist_checkpointing.save({**megatron_lm_common_state(info, 0), **sharded_state}, ckpt_dir,
                            sharded_strategy=_streaming_strategy(sources, materialise))


def _streaming_strategy(sources: dict, materialise: Callable[[str], torch.Tensor]):
    """megatron-core's torch_dist save strategy with the writing done lazily (see :func:`stream_dist`)."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    from megatron_patch.convert.direct_io import DirectFileSystemWriter

    class LazyPlanner(MCoreSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False)
            self.current: tuple[str | None, torch.Tensor | None] = (None, None)

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            name, index = sources[(write_item.index.fqn, tuple(write_item.index.offset))]
            if self.current[0] != name:  # items come in state-dict order: a swiglu fc1's halves follow each other
                self.current = (None, None)  # drop the previous group before making the next
                self.current = (name, materialise(name))
            chunk = write_item.tensor_data.chunk
            tensor = self.current[1][index].reshape(chunk.sizes)  # with the prepended layer axis
            expected = write_item.tensor_data.properties.dtype
            if tensor.dtype != expected:
                raise CheckpointMismatch(f"{name}: produced {tensor.dtype}, the model holds {expected}")
            return tensor

    class StreamingStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            dcp_save(mcore_to_pyt_state_dict(state, is_loading=False), planner=LazyPlanner(),
                     storage_writer=DirectFileSystemWriter(checkpoint_dir))

    return StreamingStrategy("torch_dist", 1)


def load_dist(chunks, ckpt_dir: str) -> None:
    """Load a torch_dist checkpoint into this rank's model chunks at whatever layout they were built."""
    from megatron.core import dist_checkpointing

    for chunk in chunks:
        check_dist_checkpoint(chunk, ckpt_dir)
        state = dist_checkpointing.load(chunk.sharded_state_dict(), ckpt_dir)
        chunk.load_state_dict(state, strict=False)


# ----------------------------------------------------------------------------------------------------------
# torch (Megatron-LM's legacy per-rank files)
# ----------------------------------------------------------------------------------------------------------


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_TT`` without pipeline parallelism, ``mp_rank_TT_PPP`` with it (Megatron-LM's naming)."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _stage_of(name: str, model_config: ModelConfig, pp: int) -> tuple[list[int], str]:
    """The pipeline stages that hold ``name`` and the name there (layers renumbered from 0 on each stage)."""
    per_stage = model_config.num_layers // pp
    match = _LAYER.match(name)
    if match:
        layer = int(match.group(2))
        return [layer // per_stage], f"{match.group(1)}{layer % per_stage}.{name[match.end():]}"
    if name.startswith("embedding."):
        stages = [0]
        # Tied embeddings: the last stage keeps its own copy as output_layer.weight (kept equal by megatron-core).
        if name == "embedding.word_embeddings.weight" and pp > 1 and not model_config.untie_embeddings_and_output_weights:
            return stages + [pp - 1], name
        return stages, name
    return [pp - 1], name


def _tp_slice(tensor: torch.Tensor, dim: int | None, gated: bool, tp_rank: int, tp: int) -> torch.Tensor:
    if dim is None:
        return tensor.clone()
    if gated:  # each rank holds [gate_shard; up_shard], not a plain chunk of [gate; up]
        gate, up = tensor.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[tp_rank], up.chunk(tp, dim=dim)[tp_rank]], dim=dim)
    return tensor.chunk(tp, dim=dim)[tp_rank].clone()  # clone: torch.save of a view writes its whole storage


def megatron_lm_args(info: CheckpointInfo, **training) -> argparse.Namespace:
    """Megatron-LM's ``args`` for a checkpoint of ``info``'s model: every field its ``load_args_from_checkpoint``
    and ``load_checkpoint`` read (megatron/training/checkpointing.py at core_v0.16.1), under its names, so
    ``--use-checkpoint-args`` rebuilds the model and a resume continues at the right sample.

    Example::

        megatron_lm_args(info, iteration=10, consumed_train_samples=80, tokenizer_type="GPT2BPETokenizer")

    ``training`` overrides what only a trainer knows (consumed samples, the tokenizer, virtual pipeline size).
    The MoE, Mamba and hybrid fields are None: Megatron-LM keeps its own flags for them, right for a dense model.
    """
    m = info.model_config
    hf_vocab = (info.hf_config or {}).get("vocab_size")
    fields = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_size, seq_length=m.seq_length,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.query_groups,
        group_query_attention=m.query_groups != m.num_attention_heads, kv_channels=m.head_dim,
        max_position_embeddings=m.max_positions, position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=m.position_embedding_type == "rope", rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent, rotary_interleaved=False, add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias, squared_relu=False, swiglu=m.activation == "swiglu",
        openai_gelu=m.activation == "gelu_tanh",
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        apply_layernorm_1p=m.layernorm_zero_centered_gamma, normalization=m.normalization,
        # Megatron-LM's flag is --norm-epsilon but its checkpoints (and check_checkpoint_args' readers) keep the
        # older name next to it; both carry the same value.
        norm_epsilon=m.layernorm_epsilon, layernorm_epsilon=m.layernorm_epsilon,
        apply_query_key_layer_scaling=False, attention_dropout=m.attention_dropout,
        hidden_dropout=m.hidden_dropout, init_method_std=m.init_method_std,
        hybrid_override_pattern=None, spec=None, hybrid_attention_ratio=None, hybrid_mlp_ratio=None,
        num_experts=None, moe_layer_freq=None, moe_ffn_hidden_size=None, moe_router_topk=None,
        moe_token_dispatcher_type=None, moe_router_pre_softmax=None, moe_grouped_gemm=None,
        moe_shared_expert_intermediate_size=None, moe_router_score_function=None,
        moe_router_enable_expert_bias=None, moe_router_topk_scaling_factor=None, moe_latent_size=None,
        mamba_state_dim=None, mamba_head_dim=None, mamba_num_groups=None, mamba_num_heads=None,
        is_hybrid_model=False, heterogeneous_layers_config_path=None,
        heterogeneous_layers_config_encoded_json=None,
        # A conversion's tokenizer is the Hugging Face one saved in hf_tokenizer/ (Megatron-LM's
        # HuggingFaceTokenizer); the path is left to the reader's --tokenizer-model, the directory may move.
        tokenizer_type="HuggingFaceTokenizer" if info.tokenizer_files else None, tokenizer_model=None,
        tiktoken_pattern=None, padded_vocab_size=info.padded_vocab_size, vocab_size=m.vocab_size or hf_vocab,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, ckpt_format=info.format,
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


def save_legacy(model, ckpt_dir: str, info: CheckpointInfo) -> None:
    """One ``model_optim_rng.pt`` per TP x PP rank, cut from the reference model's full tensors."""
    m, tp, pp = info.model_config, info.tensor_model_parallel_size, info.pipeline_model_parallel_size
    if m.num_layers % pp:
        raise ValueError(f"--target-pipeline-parallel-size {pp} must divide the {m.num_layers} layers")
    full, dims = model.state_dict(), partition_dims(model)
    common = megatron_lm_common_state(info, 0)
    for pp_rank in range(pp):
        placed = {}
        for name, value in full.items():
            stages, local = _stage_of(name, m, pp)
            if pp_rank in stages:
                placed[name] = local
        if pp > 1 and pp_rank == pp - 1 and not m.untie_embeddings_and_output_weights:
            placed["embedding.word_embeddings.weight"] = "output_layer.weight"
        for tp_rank in range(tp):
            state = {}
            for name, local in placed.items():
                value = full[name]
                state[local] = (value if not isinstance(value, torch.Tensor)
                                else _tp_slice(value, dims.get(_LAYER.sub(r"\1{}.", name)), _is_gated_fc1(name, m), tp_rank, tp))
            path = os.path.join(ckpt_dir, rank_dir_name(tp_rank, pp_rank, pp), "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": state, **common}, path)


def load_legacy_file(path: str) -> dict:
    """A legacy rank file or a common.pt, unpickled with ``weights_only=True``: besides tensors only the types
    megatron-core registers as safe (megatron/core/safe_globals.py: Megatron-LM's ``args`` Namespace, its enums,
    numpy's RNG state in ``rng_state``). Registered again here, not through torch's ``safe_globals`` context
    manager: on exit that unregisters what it was given, megatron-core's registrations included (its import
    registers them once), and megatron-core's own ``dist_checkpointing.load`` of a common.pt then fails."""
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointMismatch(f"{path} holds a type no Megatron checkpoint holds ({str(error).splitlines()[-1]}); "
                                 "load it only if you trust its source, then re-save it") from None
    except RuntimeError as error:  # torch.load's reader on a truncated or overwritten zip
        raise CheckpointMismatch(f"{path} does not load ({str(error).split('. ')[0]}): it is truncated or damaged; "
                                 "copy it again from the run that saved it") from None


def merge_legacy(ckpt_dir: str, info: CheckpointInfo, dims: dict[str, int | None]) -> dict[str, torch.Tensor]:
    """Full tensors from the per-rank files: TP shards concatenated along ``dims`` (from
    :func:`partition_dims`), layers renumbered from their stage, the tied copy on the last stage checked."""
    m, tp, pp = info.model_config, info.tensor_model_parallel_size, info.pipeline_model_parallel_size
    per_stage = m.num_layers // pp
    full, tied_copy = {}, None
    for pp_rank in range(pp):
        shards = []
        for tp_rank in range(tp):
            path = os.path.join(ckpt_dir, rank_dir_name(tp_rank, pp_rank, pp), "model_optim_rng.pt")
            if not os.path.isfile(path):
                raise CheckpointMismatch(f"{path} is missing (the checkpoint records TP={tp}, PP={pp})")
            shards.append(load_legacy_file(path)["model"])
        for local, value in shards[0].items():
            if not isinstance(value, torch.Tensor):
                continue
            match = _LAYER.match(local)
            name = (f"{match.group(1)}{int(match.group(2)) + pp_rank * per_stage}.{local[match.end():]}"
                    if match else local)
            template = _LAYER.sub(r"\1{}.", name)
            if template not in dims and template != "output_layer.weight":
                raise CheckpointMismatch(f"{local} (rank files of stage {pp_rank}) is not a tensor of the model")
            merged = _merge_tp([s[local] for s in shards], dims.get(template, 0), _is_gated_fc1(name, m))
            if name == "output_layer.weight" and template not in dims:
                tied_copy = merged  # the last stage's copy of tied embeddings, checked below
                continue
            full[name] = merged
    # With tied embeddings and PP > 1 the export takes the first stage's copy; both must agree.
    if tied_copy is not None and not torch.equal(tied_copy, full.get("embedding.word_embeddings.weight")):
        raise CheckpointMismatch("the last pipeline stage's output_layer.weight differs from the tied word "
                                 "embeddings of the first stage; the checkpoint is inconsistent")
    return full


def load_legacy(model, ckpt_dir: str, info: CheckpointInfo) -> None:
    """Merge the per-rank files into the reference (TP=1, PP=1) model, checking names and shapes."""
    full = merge_legacy(ckpt_dir, info, partition_dims(model))
    copy_full_tensors(model, full, ckpt_dir)


def copy_full_tensors(model, full: dict[str, torch.Tensor], source: str) -> None:
    target = full_state_dict(model)
    problems = [f"{n}: missing from the checkpoint (model expects {tuple(t.shape)})"
                for n, t in target.items() if n not in full]
    problems += [f"{n}: checkpoint has shape {tuple(full[n].shape)}, model expects {tuple(t.shape)}"
                 for n, t in target.items() if n in full and full[n].shape != t.shape]
    problems += [f"{n}: in the checkpoint but not a tensor of the model" for n in full if n not in target]
    if problems:
        raise CheckpointMismatch(f"{source} does not fit the model its description ({ARGS_FILE} or Megatron-LM "
                                 f"args) records: {first_problems(problems)}")
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(full[name])


def _merge_tp(shards: list[torch.Tensor], dim: int | None, gated: bool) -> torch.Tensor:
    if dim is None:
        return shards[0]
    if gated:
        gates, ups = zip(*(s.chunk(2, dim=dim) for s in shards))
        return torch.cat([*gates, *ups], dim=dim)
    return torch.cat(shards, dim=dim)


# ----------------------------------------------------------------------------------------------------------
# Either format
# ----------------------------------------------------------------------------------------------------------


def load_into_reference_model(model, megatron_dir: str, info: CheckpointInfo) -> None:
    LOADERS[info.format](model, weights_dir(megatron_dir), info)


LOADERS = {
    "torch_dist": lambda model, path, info: load_dist([model], path),
    "torch": load_legacy,
}


def load_full_into_chunks(chunks, full: dict[str, torch.Tensor]) -> None:
    """Fill this rank's chunks (any TP/PP/VPP) from full tensors, using the offsets of megatron-core's sharded
    state dict (the mapping dist_checkpointing reshards with)."""
    with torch.no_grad():
        for chunk in chunks:
            for name, sharded in _sharded_tensors(chunk.sharded_state_dict()):
                name, index = _full_index(name, sharded)
                if name == "output_layer.weight" and name not in full:
                    name = "embedding.word_embeddings.weight"  # the last stage's copy of tied embeddings
                sharded.data.copy_(full[name][index])


def _full_index(name: str, sharded) -> tuple[str, tuple[slice, ...]]:
    """The full (TP=1, PP=1) tensor a ShardedTensor is cut from, and where: its global offsets."""
    if sharded.prepend_axis_num:  # layers are stacked along a prepended axis: offset = global layer
        match = _LAYER.match(name)
        name = f"{match.group(1)}{sharded.global_offset[0]}.{name[match.end():]}"
    offsets = sharded.global_offset[sharded.prepend_axis_num:]
    return name, tuple(slice(o, o + s) for o, s in zip(offsets, sharded.local_shape))
