"""preprocess_data: round trips, Megatron-LM's bytes, the file format, and bad input."""

import glob
import gzip
import json
import os
import struct

import numpy
import pytest
from conftest_data import data_assets, write_null_corpus
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron_patch.data.jsonl import InputError
from megatron_patch.data.preprocess import PreprocessConfig, main, preprocess
from megatron_patch.data.sentences import SentenceSplitter
from megatron_patch.tokenizer import TokenizerFileError, build_tokenizer, register_tokenizer
from megatron_patch.tokenizer.null import NullTokenizer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return data_assets(tmp_path_factory)


def _input_for(tokenizer_type, assets, tmp_path):
    """The corpus path and its texts; NullTokenizer reads ids, so it gets a corpus of ids."""
    if tokenizer_type != "NullTokenizer":
        return assets.corpus, assets.texts
    path = str(tmp_path / "ids.jsonl")
    return path, write_null_corpus(path, assets.texts)


def _megatron_lm_reference(tokenizer, texts, prefix, append_eod, partitions, dtype):
    """What Megatron-LM's tool writes: one `add_document` per line (sentences dropped when they
    have no tokens, eod joined to the last), partitions filled round-robin and merged in order."""
    parts = [[t for i, t in enumerate(texts) if i % partitions == p] for p in range(partitions)]
    part_prefixes = []
    for p, part in enumerate(parts):
        part_prefix = f"{prefix}_{p}"
        builder = IndexedDatasetBuilder(part_prefix + ".bin", dtype=dtype)
        for sentences in part:
            ids = [tokenizer.tokenize(s) for s in sentences]
            ids = [x for x in ids if x]
            lengths = [len(x) for x in ids]
            flat = [i for x in ids for i in x]
            if flat and append_eod:
                flat.append(tokenizer.eod)
                lengths[-1] += 1
            builder.add_document(flat, lengths)
        builder.finalize(part_prefix + ".idx")
        part_prefixes.append(part_prefix)
    merged = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for part_prefix in part_prefixes:
        merged.add_index(part_prefix)
    merged.finalize(prefix + ".idx")
    return prefix


def _read_documents(prefix):
    dataset = IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [[dataset[s].tolist() for s in range(a, b)] for a, b in zip(bounds[:-1], bounds[1:])]


TYPES = ["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
         "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer"]


@pytest.mark.parametrize("tokenizer_type", TYPES)
@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 1), (2, 3)])
def test_round_trip_and_megatron_lm_bytes(assets, tmp_path, tokenizer_type, workers, partitions):
    path, texts = _input_for(tokenizer_type, assets, tmp_path)
    options = assets.options[tokenizer_type]
    tokenizer = build_tokenizer(tokenizer_type, **options)
    prefix = str(tmp_path / "out" / "corpus")
    report = preprocess(PreprocessConfig(
        input=path, output_prefix=prefix, tokenizer_type=tokenizer_type, tokenizer_options=options,
        append_eod=True, workers=workers, partitions=partitions, batch_lines=37,
    ))
    out = prefix + "_text_document"
    assert report.outputs == [out] and report.documents == len(texts)

    # 1. Tokens read back through megatron-core equal the tokenizer's, plus eod, in Megatron-LM's order.
    order = [i for p in range(partitions) for i in range(len(texts)) if i % partitions == p]
    expected = [[tokenizer.tokenize(texts[i]) + [tokenizer.eod]] for i in order]
    assert _read_documents(out) == expected

    # 2. The files are byte-identical to Megatron-LM's procedure.
    reference = _megatron_lm_reference(
        tokenizer, [[t] for t in texts], str(tmp_path / "reference"), True, partitions,
        DType.optimal_dtype(tokenizer.vocab_size),
    )
    for suffix in (".bin", ".idx"):
        with open(out + suffix, "rb") as a, open(reference + suffix, "rb") as b:
            assert a.read() == b.read(), suffix
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def _reference_index(sequence_lengths, document_indices, dtype_code, itemsize):
    """The `.idx` layout written from its description, independently of megatron-core's writer:
    magic, version 1 (u64), dtype code (u8), #sequences (u64), #documents+1 (u64), lengths
    (i32), byte pointers (i64), document boundaries (i64), all little-endian."""
    pointers = numpy.concatenate([[0], numpy.cumsum(sequence_lengths)[:-1]]) * itemsize
    return (
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, len(sequence_lengths), len(document_indices))
        + numpy.asarray(sequence_lengths, "<i4").tobytes() + numpy.asarray(pointers, "<i8").tobytes()
        + numpy.asarray(document_indices, "<i8").tobytes()
    )


def test_index_layout_matches_the_documented_format(tmp_path):
    docs = ["1 2 3", "4", "5 6 7 8 9", "10 11"]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = str(tmp_path / "x")
    for vocab_size, dtype_code, itemsize, numpy_dtype in [(1000, 8, 2, "<u2"), (70000, 4, 4, "<i4")]:
        preprocess(PreprocessConfig(
            input=str(path), output_prefix=prefix, tokenizer_type="NullTokenizer",
            tokenizer_options={"vocab_size": vocab_size}, append_eod=True, workers=1,
        ))
        eod = vocab_size
        tokens = [[int(x) for x in d.split()] + [eod] for d in docs]
        with open(prefix + "_text_document.idx", "rb") as f:
            assert f.read() == _reference_index([len(t) for t in tokens], [0, 1, 2, 3, 4], dtype_code, itemsize)
        with open(prefix + "_text_document.bin", "rb") as f:
            assert f.read() == numpy.asarray([i for t in tokens for i in t], numpy_dtype).tobytes()


def test_split_sentences_one_partition_writes_sentence_files(assets, tmp_path):
    options = assets.options["BertWordPieceLowerCase"]
    tokenizer = build_tokenizer("BertWordPieceLowerCase", **options)
    prefix = str(tmp_path / "bert")
    report = preprocess(PreprocessConfig(
        input=assets.corpus, output_prefix=prefix, tokenizer_type="BertWordPieceLowerCase",
        tokenizer_options=options, split_sentences=True, workers=2,
    ))
    # Megatron-LM #1052: one partition with --split-sentences wrote nothing.
    out = prefix + "_text_sentence"
    assert report.outputs == [out]
    splitter = SentenceSplitter()
    expected = [[ids for ids in (tokenizer.tokenize(s) for s in splitter.split(t)) if ids] for t in assets.texts]
    assert _read_documents(out) == expected
    assert report.sequences > 2 * report.documents


def test_sentence_splitter():
    splitter = SentenceSplitter()
    assert splitter.split("Dr. Smith met J. Doe. He left! Did he? Yes.") == [
        "Dr. Smith met J. Doe.", "He left!", "Did he?", "Yes."]
    assert splitter.split('He said "Stop." Then 3 dogs ran.\n\nnew para') == [
        'He said "Stop."', "Then 3 dogs ran.", "new para"]
    assert splitter.split("pi is 3.14 and e.g. this one. done") == ["pi is 3.14 and e.g. this one. done"]
    text = "One.\nTwo.  Three."
    kept = SentenceSplitter(keep_newlines=True).split(text)
    assert kept == ["One.\n", "Two.  ", "Three."] and "".join(kept) == text


def test_gz_and_glob_inputs_and_multiple_keys(tmp_path):
    lines = [json.dumps({"text": f"{i} {i + 1}", "title": f"{i}"}) + "\n" for i in range(50)]
    (tmp_path / "a.jsonl").write_text("".join(lines[:20]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(lines[20:]))
    prefix = str(tmp_path / "out")
    preprocess(PreprocessConfig(
        input=str(tmp_path / "*.jsonl*"), output_prefix=prefix, tokenizer_type="NullTokenizer",
        tokenizer_options={"vocab_size": 100}, json_keys=["text", "title"], workers=2, batch_lines=7,
    ))
    assert _read_documents(prefix + "_text_document") == [[[i, i + 1]] for i in range(50)]
    assert _read_documents(prefix + "_title_document") == [[[i]] for i in range(50)]


def test_keep_sequential_samples_keeps_input_order(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"text": str(i)}) + "\n" for i in range(10)))
    prefix = str(tmp_path / "out")
    preprocess(PreprocessConfig(
        input=str(path), output_prefix=prefix, tokenizer_type="NullTokenizer", tokenizer_options={"vocab_size": 100},
        partitions=3, keep_sequential_samples=True, batch_lines=4,
    ))
    assert _read_documents(prefix + "_text_document") == [[[i]] for i in range(10)]


GOOD = json.dumps({"text": "1 2 3"}).encode() + b"\n"
BAD_LINES = {
    "malformed JSON": b'{"text": "1 2\n',
    "missing key": json.dumps({"body": "1 2"}).encode() + b"\n",
    "not a string": json.dumps({"text": 12}).encode() + b"\n",
    "invalid UTF-8": b'{"text": "1 \xff 2"}\n',
    "empty document": json.dumps({"text": ""}).encode() + b"\n",
}


def _null_config(path, prefix, **overrides):
    return PreprocessConfig(
        input=str(path), output_prefix=str(prefix), tokenizer_type="NullTokenizer",
        tokenizer_options={"vocab_size": 100}, workers=2, batch_lines=3, **overrides,
    )


def _no_outputs(directory):
    return [name for name in os.listdir(directory) if name.startswith("out")] == []


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_line_names_file_and_line_and_leaves_no_output(tmp_path, reason):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 7 + BAD_LINES[reason] + GOOD * 5)
    with pytest.raises(InputError, match=rf"in.jsonl:8: {reason}"):
        preprocess(_null_config(path, tmp_path / "out"))
    assert _no_outputs(tmp_path)


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_skip_invalid_skips_and_counts(tmp_path, reason):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 7 + BAD_LINES[reason] + GOOD * 5)
    report = preprocess(_null_config(path, tmp_path / "out", skip_invalid=True))
    assert report.skipped == {reason: 1} and report.documents == 12
    assert _read_documents(str(tmp_path / "out_text_document")) == [[[1, 2, 3]]] * 12
    assert f"skipped 1 lines (1 {reason})" in report.summary()


def test_keep_empty_writes_an_empty_document_like_megatron_lm(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD + BAD_LINES["empty document"] + GOOD)
    preprocess(_null_config(path, tmp_path / "out", keep_empty=True))
    assert _read_documents(str(tmp_path / "out_text_document")) == [[[1, 2, 3]], [], [[1, 2, 3]]]


def test_missing_input_and_bad_vocab_are_clear_errors(assets, tmp_path, capsys):
    with pytest.raises(InputError, match="nothing.jsonl: no such file"):
        preprocess(_null_config(tmp_path / "nothing.jsonl", tmp_path / "out"))
    gpt2 = assets.options["GPT2BPETokenizer"]
    argv = ["--input", assets.corpus, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
            "GPT2BPETokenizer", "--vocab", gpt2["merge_file"], "--merge-file", gpt2["merge_file"],
            "--dataset-impl", "mmap", "--workers", "1"]
    assert main(argv) == 1
    assert "merges.txt:1: not a GPT-2 vocab.json" in capsys.readouterr().err
    assert _no_outputs(tmp_path)
    with pytest.raises(TokenizerFileError):
        preprocess(PreprocessConfig(input=assets.corpus, output_prefix=str(tmp_path / "out"),
                                    tokenizer_type="BertWordPieceCase",
                                    tokenizer_options={"vocab_file": gpt2["vocab_file"]}))


def test_failed_run_keeps_previous_outputs_untouched(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 10)
    preprocess(_null_config(path, tmp_path / "out"))
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if n.startswith("out")}
    path.write_bytes(GOOD * 20 + BAD_LINES["missing key"])
    with pytest.raises(InputError):
        preprocess(_null_config(path, tmp_path / "out"))
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if n.startswith("out")}
    assert after == before


@register_tokenizer("_DyingTokenizer")
class _DyingTokenizer(NullTokenizer):
    """Kills its worker process on the text "99", as an out-of-memory kill would."""

    def tokenize_batch(self, texts):
        if "99" in texts:
            os._exit(9)
        return super().tokenize_batch(texts)


def test_dead_worker_fails_the_run(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 10 + json.dumps({"text": "99"}).encode() + b"\n" + GOOD * 10)
    config = _null_config(path, tmp_path / "out")
    config.tokenizer_type = "_DyingTokenizer"
    with pytest.raises(RuntimeError, match="worker died"):
        preprocess(config)
    assert _no_outputs(tmp_path)


def test_cli_logs_progress_lines_when_not_a_tty(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 30)
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--workers", "2", "--log-interval", "10", "--append-eod"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "docs |" in err and "MB/s" in err and "tok/s" in err and "ETA" in err
    assert "Done: 30 documents, 30 sequences, 120 tokens" in err
    assert _read_documents(str(tmp_path / "out_text_document"))[0] == [[1, 2, 3, 100]]
    assert not glob.glob(str(tmp_path / "*tmp*"))
