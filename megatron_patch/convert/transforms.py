"""Named tensor transforms between Hugging Face and megatron-core layouts, each with its exact inverse.

Example::

    from megatron_patch.convert.transforms import Shapes, apply_to_hf, apply_to_mcore
    shapes = Shapes(num_attention_heads=4, num_query_groups=2, kv_channels=8, vocab_size=100, padded_vocab_size=128)
    [qkv] = apply_to_mcore(("fuse_qkv",), [q, k, v], shapes)          # megatron's per-group [q; k; v]
    q2, k2, v2 = apply_to_hf(("fuse_qkv",), qkv, shapes)               # bit-identical to q, k, v

A transform maps a list of tensors to a list of tensors, so a mapping rule can chain several
(GPT-2's fused ``c_attn`` is ``("transpose", "fuse_stacked_qkv")``); going back applies the inverses in reverse
order. Every transform is a pure reshape/concatenate/slice, so a round trip reproduces every bit, and applying
one to ``meta`` tensors yields the shapes a checkpoint must have without reading any data.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import torch

Tensors = list[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes the layout transforms need (derived once from a ModelConfig)."""

    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    padded_vocab_size: int


@dataclasses.dataclass(frozen=True)
class Transform:
    """``to_mcore`` turns the Hugging Face tensors of one rule into megatron's; ``to_hf`` undoes it exactly."""

    to_mcore: Callable[[Tensors, Shapes], Tensors]
    to_hf: Callable[[Tensors, Shapes], Tensors]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """Separate q/k/v projections (weights or biases) -> megatron's ``linear_qkv``, grouped per query group:
    ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]``
    (``SelfAttention.get_query_key_value_tensors`` in megatron/core/transformer/attention.py). Tensor
    parallelism then hands each rank whole groups by a plain split of dim 0.

    Example::

        >>> s = Shapes(num_attention_heads=4, num_query_groups=2, kv_channels=1, vocab_size=1, padded_vocab_size=1)
        >>> fuse_qkv(torch.tensor([0., 1, 2, 3]), torch.tensor([10., 11]), torch.tensor([20., 21]), s).tolist()
        [0.0, 1.0, 10.0, 20.0, 2.0, 3.0, 11.0, 21.0]
    """
    groups, d = shapes.num_query_groups, shapes.kv_channels
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    ).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, shapes: Shapes) -> Tensors:
    """The inverse of :func:`fuse_qkv`: megatron's grouped ``linear_qkv`` -> contiguous q, k, v."""
    groups, d = shapes.num_query_groups, shapes.kv_channels
    q_per_group = shapes.num_attention_heads // groups * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, q_per_group + 2 * d, *rest).split([q_per_group, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def _qkv_rows(shapes: Shapes) -> list[int]:
    """The rows of q, k and v in a projection that stacks them."""
    d = shapes.kv_channels
    return [shapes.num_attention_heads * d, shapes.num_query_groups * d, shapes.num_query_groups * d]


def pad_vocab(t: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """Append zero rows up to the padded vocabulary (Megatron pads to a multiple of
    ``make_vocab_size_divisible_by x TP`` so that every TP rank holds the same number of rows)."""
    if t.shape[0] != shapes.vocab_size:
        raise ValueError(f"a vocabulary tensor has {t.shape[0]} rows, the config says vocab_size {shapes.vocab_size}")
    padding = t.new_zeros((shapes.padded_vocab_size - t.shape[0], *t.shape[1:]))
    return torch.cat([t, padding])


def _one(fn):
    """Lift a tensor -> tensor function to the list -> list form of a transform step."""
    return lambda tensors, shapes: [fn(tensors[0], shapes)]


TRANSFORMS: dict[str, Transform] = {
    # Conv1D (GPT-2) stores [in, out], the transpose of nn.Linear and of megatron's [out, in].
    "transpose": Transform(
        to_mcore=lambda ts, s: [t.t().contiguous() for t in ts],
        to_hf=lambda ts, s: [t.t().contiguous() for t in ts],
    ),
    "fuse_qkv": Transform(
        to_mcore=lambda ts, s: [fuse_qkv(*ts, s)],
        to_hf=lambda ts, s: split_qkv(ts[0], s),
    ),
    # One projection whose output is [q; k; v]: GPT-2's c_attn (each of the full width), Phi-3's qkv_proj (k and v
    # of the query groups' width).
    "fuse_stacked_qkv": Transform(
        to_mcore=lambda ts, s: [fuse_qkv(*ts[0].split(_qkv_rows(s)), s)],
        to_hf=lambda ts, s: [torch.cat(split_qkv(ts[0], s))],
    ),
    # SwiGLU: megatron's linear_fc1 is [gate; up] along the output dimension (MLP.forward chunks it in two).
    "fuse_gate_up": Transform(
        to_mcore=lambda ts, s: [torch.cat(ts)],
        to_hf=lambda ts, s: [t.contiguous() for t in ts[0].chunk(2)],
    ),
    # One megatron tensor stored twice by Hugging Face (DeepSeek-V3's multi-token prediction layer keeps copies of the
    # embedding and output matrices, which megatron-core's MTP shares with the model); the converter checks that
    # the copies are equal before it writes anything (convert/core.py).
    "shared_copy": Transform(
        to_mcore=lambda ts, s: [ts[0], *ts[2:]],
        to_hf=lambda ts, s: [ts[0], ts[0].clone()],
    ),
    "pad_vocab": Transform(
        to_mcore=_one(pad_vocab),
        to_hf=lambda ts, s: [ts[0][: s.vocab_size].contiguous()],
    ),
}


def _lookup(name: str) -> Transform:
    try:
        return TRANSFORMS[name]
    except KeyError:
        raise KeyError(f"unknown transform {name!r}; known: {sorted(TRANSFORMS)}") from None


def apply_to_mcore(names: Sequence[str], tensors: Sequence[torch.Tensor], shapes: Shapes) -> Tensors:
    """Run the named transforms in order (Hugging Face -> megatron-core)."""
    out = list(tensors)
    for name in names:
        out = _lookup(name).to_mcore(out, shapes)
    return out


def apply_to_hf(names: Sequence[str], tensor: torch.Tensor, shapes: Shapes) -> Tensors:
    """Run the inverses in reverse order (megatron-core -> Hugging Face)."""
    out = [tensor]
    for name in reversed(names):
        out = _lookup(name).to_hf(out, shapes)
    return out


# Transforms that only move whole rows (dim 0) or add zero rows. A rule made of them alone is read straight into its
# megatron tensor, each run of rows where it belongs (:func:`row_runs`): no intermediate tensors, no concatenation.
ROW_MOVES = frozenset({"fuse_qkv", "fuse_stacked_qkv", "fuse_gate_up", "pad_vocab"})


@dataclasses.dataclass(frozen=True)
class RowRun:
    """``rows`` consecutive rows of the megatron tensor from row ``start``: rows ``source_start ...`` of the rule's
    Hugging Face tensor number ``source``, or zeros where ``source`` is None."""

    start: int
    rows: int
    source: int | None
    source_start: int


@functools.lru_cache(maxsize=None)
def row_runs(names: tuple[str, ...], hf_shapes: tuple[tuple[int, ...], ...],
             shapes: Shapes) -> tuple[RowRun, ...] | None:
    """Where each row of the megatron tensor comes from, when ``names`` only move rows (else None), for Hugging
    Face tensors of shapes ``hf_shapes``.

    Example::

        >>> s = Shapes(num_attention_heads=4, num_query_groups=2, kv_channels=1, vocab_size=1, padded_vocab_size=1)
        >>> [(r.start, r.rows, r.source, r.source_start) for r in row_runs(("fuse_qkv",), ((4, 3), (2, 3), (2, 3)), s)]
        [(0, 2, 0, 0), (2, 1, 1, 0), (3, 1, 2, 0), (4, 2, 0, 2), (6, 1, 1, 1), (7, 1, 2, 1)]

    The transforms themselves are run on one tag per row (source number + 1 in the high bits, the row below), so
    the runs follow whatever the transforms do; a zero tag is a padding row. Cached: every layer has the same.
    """
    if not names or not set(names) <= ROW_MOVES:
        return None
    [tags] = apply_to_mcore(names, [torch.arange(s[0]) + ((i + 1) << 32) for i, s in enumerate(hf_shapes)], shapes)
    source, row = tags >> 32, tags & ((1 << 32) - 1)
    continues = (source[1:] == source[:-1]) & ((row[1:] == row[:-1] + 1) | (source[1:] == 0))
    starts = [0, *(continues.logical_not().nonzero().flatten() + 1).tolist()]
    ends = [*starts[1:], len(tags)]
    return tuple(RowRun(a, b - a, int(source[a]) - 1 if source[a] else None, int(row[a])) for a, b in zip(starts, ends))
