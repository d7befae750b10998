"""A BERT that Megatron-LM's pretrain_bert.py trained loads as our pre-LN BERT, and a Megatron-LM checkpoint's
vocabulary comes from its padded embedding when its args leave ``vocab_size`` (and ``padded_vocab_size``) unset.

Example::

    python -m pytest -q tests/test_megatron_lm_bert_checkpoints.py

The BERT checkpoints hold a tiny random megatron-core ``BertModel`` with Megatron-LM's pre-LN layers (the local
layer spec pretrain_bert.py builds), laid out as Megatron-LM's ``save_checkpoint`` lays out a save
(megatron/training/checkpointing.py at core_v0.16.1): ``iter_0000003/`` named by a tracker holding ``3``; torch_dist
as the model's sharded state under "model" with the args beside it in common.pt, legacy as TP=2
``mp_rank_TT/model_optim_rng.pt`` files. Their args are pretrain_bert.py's: ``tokenizer_type``
BertWordPieceLowerCase, ``bert_binary_head``, ``vocab_size`` None (Megatron-LM sets it only with --vocab-size),
no ``num_tokentypes`` and none of our own fields. The reference is the saved model's own output.
"""

import argparse
import glob
import os

import pytest
import torch

from megatron_patch.checkpoint.format import CheckpointMismatch, info_from_megatron_lm, load_megatron_file, read_info
from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import cli

ITERATION = 3
TOKENS = [[2, 17, 33, 5, 90, 41, 3, 8], [2, 64, 7, 100, 12, 9, 3, 0]]


def _inputs() -> dict:
    tokens = torch.tensor(TOKENS)
    return {"tokens": tokens, "attention_mask": (tokens != 0).long(),
            "types": torch.tensor([[0] * 4 + [1] * 4] * 2)}


def _megatron_lm_bert_args(info, **changes) -> argparse.Namespace:
    """The args pretrain_bert.py's run stores: ours for the model, less the fields Megatron-LM's args lack."""
    from megatron_patch.checkpoint.format import megatron_lm_args

    args = megatron_lm_args(info, tokenizer_type="BertWordPieceLowerCase", vocab_size=None, **changes)
    del args.megatron_patch, args.num_tokentypes  # our own fields
    return args


def save_megatron_lm_bert(rank, world_size, out: str, fmt: str, drop_padded: bool) -> dict:
    """Build a pre-LN BERT, save it in ``out`` as Megatron-LM's save_checkpoint does in ``fmt`` and return its
    outputs on :data:`TOKENS` (logits over the padded vocabulary and the binary head's)."""
    from megatron.core import dist_checkpointing

    from megatron_patch.checkpoint.format import CheckpointInfo
    from megatron_patch.checkpoint.legacy import save_legacy
    from megatron_patch.convert.verify import megatron_outputs
    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig

    initialize_distributed(seed=11)
    model = get_model_config("tiny-bert").replace(bert_layernorm_style="pre", hidden_dropout=0.0,
                                                  attention_dropout=0.0)
    info = CheckpointInfo(fmt, model, padded_vocab_size=128, tensor_model_parallel_size=2 if fmt == "torch" else 1)
    [chunk] = build_model_chunks(model, ParallelConfig(), 128)
    expected = megatron_outputs([chunk], info, _inputs(), {"logits", "binary_logits"})
    path = os.path.join(out, f"iter_{ITERATION:07d}")
    os.makedirs(path)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    common = {"args": _megatron_lm_bert_args(info), "checkpoint_version": 3.0, "iteration": ITERATION}
    if drop_padded:
        del common["args"].padded_vocab_size
    if fmt == "torch_dist":
        dist_checkpointing.save({**common, "model": chunk.sharded_state_dict()}, path)
    else:
        save_legacy(chunk, path, info)  # TP=2 rank files; their args are then replaced by Megatron-LM's
        for file in glob.glob(os.path.join(path, "mp_rank_*", "model_optim_rng.pt")):
            torch.save({**load_megatron_file(file), **common}, file)
    return expected


def load_as_trainer(rank, world_size, load: str, family: str):
    """The outputs of the model a ``family`` trainer builds from ``--load`` and loads (as --finetune), or the
    error that refuses it."""
    from megatron_patch.convert.verify import megatron_outputs
    from megatron_patch.checkpoint.megatron import load_megatron_checkpoint
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.models import megatron_model

    engine = Engine(["--load", load, "--micro-batch-size", "2", "--finetune"])
    try:
        chunks, info = megatron_model(engine, family=family)
    except SystemExit as refused:
        return str(refused)
    load_megatron_checkpoint(load, chunks, None, None, finetune=True)
    return megatron_outputs(chunks, info, _inputs(), {"logits", "binary_logits"})


@pytest.fixture(scope="module")
def bert_checkpoints(tmp_path_factory):
    """{layout: (directory, the saved model's outputs)}; the legacy one's args lack padded_vocab_size too."""
    root = tmp_path_factory.mktemp("megatron_lm_bert")
    made = {}
    for fmt in ("torch_dist", "torch"):
        out = str(root / fmt)
        [made[fmt]] = [(out, outputs) for outputs in run_on_ranks(
            save_megatron_lm_bert, 1, args=(out, fmt, fmt == "torch"), timeout=300)]
    return made


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_megatron_lm_bert_loads_as_pre_ln_bert_in_the_trainer(bert_checkpoints, fmt):
    """Failed before: read as a GPT (family 'gpt'), its encoder's tensors matching none of a GPT's; the legacy one
    was refused for its missing args.padded_vocab_size."""
    load, expected = bert_checkpoints[fmt]
    model = read_info(load).model_config
    assert (model.family, model.bert_layernorm_style, model.add_binary_head, model.num_tokentypes) == (
        "bert", "pre", True, 2)
    # No vocab_size in the args: the vocabulary is the embedding's 128 rows (64 in each of the two rank files).
    assert (read_info(load).padded_vocab_size, model.vocab_size) == (128, 128)
    [got] = run_on_ranks(load_as_trainer, 1, args=(load, "bert"), timeout=300)
    assert got.keys() == expected.keys() == {"logits", "binary_logits"}
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    [refusal] = run_on_ranks(load_as_trainer, 1, args=(load, "gpt"), timeout=300)
    assert refusal.endswith("describes a bert model; this trainer trains gpt models"), refusal


def test_megatron_lm_bert_export_is_refused_by_name(bert_checkpoints, tmp_path):
    """Hugging Face's BERT is post-LN: a pre-LN one has no Hugging Face architecture to be exported to, so
    megatron-to-hf refuses it by its norm placement, before reading weights, and writes nothing."""
    from megatron_patch.checkpoint.format import read_info
    from megatron_patch.model.conversion import family_for

    load, _ = bert_checkpoints["torch_dist"]
    with pytest.raises(ValueError, match="this BERT is pre-LN .*--bert-layernorm-style post to export"):
        family_for({"model_type": "bert"}).config_to_hf(read_info(load).model_config)
    exported = str(tmp_path / "exported")
    [code] = run_on_ranks(cli, 1, args=(["megatron-to-hf", "--model-type", "bert", "--load-dir", load, "--save-dir",
                                         exported, "--no-progress"],), timeout=300)
    assert code != 0 and not os.path.exists(os.path.join(exported, "config.json"))


def _rank_file(**args) -> dict:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, tensor_model_parallel_size=2)
    return {"args": argparse.Namespace(**{**fields, **args}), "checkpoint_version": 3.0, "iteration": 1,
            "model": {"embedding.word_embeddings.weight": torch.zeros(96, 32)}}


@pytest.mark.parametrize("args, vocab", [
    (dict(padded_vocab_size=192, vocab_size=None), (192, 192)),  # Megatron-LM's args without --vocab-size
    (dict(padded_vocab_size=192, vocab_size=150), (192, 150)),
    (dict(), (192, 192)),                                        # no record at all: 96 rows on each of 2 TP ranks
])
def test_vocabulary_comes_from_the_padded_embedding_when_the_args_lack_it(args, vocab):
    """Failed before: without padded_vocab_size the checkpoint was refused ('the embedding's size is unknown')."""
    info = info_from_megatron_lm(_rank_file(**args), "torch", "mp_rank_00/model_optim_rng.pt")
    assert (info.padded_vocab_size, info.model_config.vocab_size) == vocab


def test_no_vocabulary_anywhere_is_refused_by_name():
    state = _rank_file()
    del state["model"]
    with pytest.raises(CheckpointMismatch, match="args.padded_vocab_size is missing and no "
                                                 "embedding.word_embeddings.weight is stored"):
        info_from_megatron_lm(state, "torch", "mp_rank_00_001/model_optim_rng.pt")
