"""megatron-core GPT and BERT datasets built over our preprocessed files yield correct samples."""

import json
import struct
import sys

import megatron.core.datasets.utils
import numpy
import pytest
import torch
from conftest_data import data_assets

from megatron_patch.data.datasets import build_bert_datasets, build_gpt_datasets, parse_data_path
from megatron_patch.data.preprocess import PreprocessConfig, preprocess
from megatron_patch.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return data_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def forbid_compile_helpers(monkeypatch):
    """Fail the test if megatron-core's `compile_helpers()` runs: on the wheel install it runs
    `make` without a Makefile and then `sys.exit(1)`s the process. The datasets here are built
    in this process, so replacing it here (and wherever a module imported it by name) is where
    a call would land."""
    original = megatron.core.datasets.utils.compile_helpers

    def fail():
        raise AssertionError("megatron-core's compile_helpers() was called; use the prebuilt helpers_cpp")

    holders = [m for m in list(sys.modules.values()) if getattr(m, "compile_helpers", None) is original]
    for module in holders:
        monkeypatch.setattr(module, "compile_helpers", fail)


def _as_text(ids) -> str:
    """Token ids as ",1,2,3," so that `in` finds whole-token subsequences."""
    return "," + ",".join(str(int(i)) for i in ids) + ","


def _preprocess(assets, tmp_path, name, texts, tokenizer_type, **options):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    report = preprocess(PreprocessConfig(
        input=str(path), output_prefix=str(tmp_path / name), tokenizer_type=tokenizer_type,
        tokenizer_options=assets.options[tokenizer_type], workers=2, **options,
    ))
    return report.outputs[0]


def test_gpt_blend_and_split(assets, tmp_path):
    tok = build_tokenizer("GPT2BPETokenizer", **assets.options["GPT2BPETokenizer"])
    half = len(assets.texts) // 2
    a = _preprocess(assets, tmp_path, "a", assets.texts[:half], "GPT2BPETokenizer", append_eod=True)
    b = _preprocess(assets, tmp_path, "b", assets.texts[half:], "GPT2BPETokenizer", append_eod=True)
    seq_length = 32
    # Megatron-LM's usual split leaves ~100 documents no test share; megatron-core would hang.
    with pytest.raises(ValueError, match="leaves the test split of .* empty"):
        build_gpt_datasets(["0.3", a, "0.7", b], split="969,30,1", seq_length=seq_length, tokenizer=tok,
                           train_valid_test_num_samples=[400, 40, 4])
    train, valid, test = build_gpt_datasets(
        ["0.3", a, "0.7", b], split="80,15,5", seq_length=seq_length, tokenizer=tok,
        train_valid_test_num_samples=[400, 40, 4], seed=7, data_cache_path=str(tmp_path / "cache"),
    )
    assert len(train) >= 400 and len(valid) >= 40 and len(test) >= 4
    # The blend draws from a and b in proportion to their weights.
    share_a = numpy.mean(numpy.asarray(train.dataset_index) == 0)
    assert abs(share_a - 0.3) < 0.02

    documents = {
        _as_text(tok.tokenize(t)) for t in assets.texts
    }
    for index in range(0, 400, 7):
        sample = train[index]
        tokens, labels = sample["tokens"], sample["labels"]
        assert (tokens.shape == labels.shape == sample["loss_mask"].shape == sample["position_ids"].shape
                == (seq_length,))
        assert sample["attention_mask"].shape == (1, seq_length, seq_length)
        assert torch.equal(sample["attention_mask"][0], ~torch.ones(seq_length, seq_length).tril().bool())
        assert torch.equal(labels[:-1], tokens[1:]) and bool(sample["loss_mask"].all())
        assert torch.equal(sample["position_ids"], torch.arange(seq_length))
        # Split at eod, every piece is a run of tokens of one corpus document.
        window = torch.cat([tokens, labels[-1:]]).tolist()
        pieces, piece = [], []
        for token in window:
            if token == tok.eod:
                pieces.append(piece)
                piece = []
            else:
                piece.append(token)
        pieces.append(piece)
        for piece in filter(None, pieces):
            assert any(_as_text(piece) in doc for doc in documents), piece


def test_gpt_mock_data(assets):
    tok = build_tokenizer("GPT2BPETokenizer", **assets.options["GPT2BPETokenizer"])
    train, valid, test = build_gpt_datasets(
        None, split="1,1,1", seq_length=16, tokenizer=tok, train_valid_test_num_samples=[10, 4, 4], mock=True,
    )
    sample = train[3]
    assert sample["tokens"].shape == (16,) and torch.equal(sample["labels"][:-1], sample["tokens"][1:])
    assert len(valid) >= 4 and len(test) >= 4


def test_bert_masked_lm_with_binary_head(assets, tmp_path):
    tok = build_tokenizer("BertWordPieceLowerCase", **assets.options["BertWordPieceLowerCase"])
    prefix = _preprocess(assets, tmp_path, "bert", assets.texts, "BertWordPieceLowerCase", split_sentences=True)
    seq_length = 64
    train, valid, test = build_bert_datasets(
        [prefix], split="95,5,0", seq_length=seq_length, tokenizer=tok, train_valid_test_num_samples=[200, 20, 0],
        seed=3, data_cache_path=str(tmp_path / "cache"),
    )
    assert test is None and len(train) >= 200 and len(valid) >= 20
    documents = [_as_text(i for s in sentences for i in s) for sentences in _document_tokens(prefix)]
    randoms, masked = set(), 0
    for index in range(0, 200, 3):
        sample = train[index]
        text, loss_mask, labels = sample["text"], sample["loss_mask"], sample["labels"]
        assert text.shape == sample["types"].shape == labels.shape == sample["padding_mask"].shape == (seq_length,)
        assert text[0] == tok.cls
        original = text.copy()
        original[loss_mask == 1] = labels[loss_mask == 1]
        assert numpy.all(labels[loss_mask == 0] == -1)
        length = int(sample["padding_mask"].sum())
        assert numpy.all(sample["padding_mask"][:length] == 1) and numpy.all(text[length:] == tok.pad)
        seps = numpy.flatnonzero(original[:length] == tok.sep)
        assert len(seps) == 2 and seps[-1] == length - 1
        segment_a, segment_b = original[1 : seps[0]], original[seps[0] + 1 : seps[1]]
        assert numpy.all(sample["types"][: seps[0] + 1] == 0) and numpy.all(sample["types"][seps[0] + 1 : length] == 1)
        for segment in (segment_a, segment_b):
            assert any(_as_text(segment) in doc for doc in documents)
        randoms.add(sample["is_random"])
        masked += int(loss_mask.sum())
        assert set(text[loss_mask == 1].tolist()) <= set(tok.inv_vocab)
    assert randoms == {0, 1}
    assert masked > 0


def _document_tokens(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [[dataset[s].tolist() for s in range(a, b)] for a, b in zip(bounds[:-1], bounds[1:])]


def test_parse_data_path(assets, tmp_path):
    prefix = _preprocess(assets, tmp_path, "p", assets.texts[:5], "GPT2BPETokenizer")
    assert parse_data_path(["0.3", prefix, "0.7", prefix]) == ([prefix, prefix], [0.3, 0.7])
    assert parse_data_path([f"0.3 {prefix} 0.7 {prefix}"]) == ([prefix, prefix], [0.3, 0.7])
    assert parse_data_path([prefix]) == ([prefix], None)
    with pytest.raises(ValueError, match="not found"):
        parse_data_path([str(tmp_path / "missing_text_document")])
    with pytest.raises(ValueError, match="alternate"):
        parse_data_path(["0.3", prefix, "0.7"])


@pytest.mark.parametrize("words", [["a"], ["a", "b"], ["a", "b", "c"], ["0.3", "a", "0.7", "b"], ["1", "a"],
                                   ["30", "a", "70", "b", "0", "c"], ["1e-2", "a", "2", "b"]])
def test_the_launchers_check_finds_the_prefixes_megatron_core_reads(tmp_path, words):
    """The launcher checks --data-path without megatron-core; the prefixes it checks are those megatron-core's
    parser, which the ranks use, reads."""
    from megatron.core.datasets.utils import get_blend_from_list

    from megatron_patch.data.data_path import check_data_path

    named = [word if word[0].isdigit() else str(tmp_path / word) for word in words]
    for word in words:
        (tmp_path / (word + ".bin")).write_bytes(b"tokens")
        # an index of no sequences: the launcher reads its header too
        (tmp_path / (word + ".idx")).write_bytes(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, 0, 0))
    assert check_data_path(named) == get_blend_from_list(named)[0]


def test_a_hugging_face_bert_is_never_given_the_ids_megatron_appends(assets, tmp_path):
    """Megatron's BERT tokenizer appends [BOS] and [EOS] after the vocab file's ids; masking replaces tokens with any
    id it knows, so the data for a Hugging Face BERT of that vocab file (whose embedding has no rows for them) must
    know only the file's."""
    from megatron_patch.training.data import _VocabFileOnly

    tok = build_tokenizer("BertWordPieceLowerCase", **assets.options["BertWordPieceLowerCase"])
    with open(assets.options["BertWordPieceLowerCase"]["vocab_file"]) as f:
        in_file = sum(1 for line in f if line.strip())
    assert tok.appended_ids == {in_file, in_file + 1} and tok.appended_ids <= set(tok.inv_vocab)
    prefix = _preprocess(assets, tmp_path, "bert", assets.texts, "BertWordPieceLowerCase", split_sentences=True)
    [train, _, _] = build_bert_datasets([prefix], split="1,0,0", seq_length=64, tokenizer=_VocabFileOnly(tok),
                                        train_valid_test_num_samples=[2000, 0, 0], seed=3)
    replaced = numpy.concatenate([train[i]["text"][train[i]["loss_mask"] == 1] for i in range(2000)])
    assert len(replaced) > 1000 and replaced.max() < in_file
