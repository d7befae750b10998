"""preprocess_data: round trips, Megatron-LM's bytes, the file format, and bad input."""

import functools
import glob
import gzip
import io
import json
import os
import random
import re
import struct
import subprocess
import sys
import types

import numpy
import pytest
from conftest_data import data_assets, write_null_corpus
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron_patch.compat import collect_only_new_objects
from megatron_patch.data import preprocess as preprocess_module
from megatron_patch.data import progress as progress_module
from megatron_patch.data.jsonl import InputError
from megatron_patch.data.preprocess import PreprocessConfig, main, preprocess
from megatron_patch.data.progress import Progress
from megatron_patch.data.sentences import SentenceSplitter, last_word
from megatron_patch.errors import UserError
from megatron_patch.tokenizer import TokenizerFileError, build_tokenizer, register_tokenizer
from megatron_patch.tokenizer.null import NullTokenizer


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        with collect_only_new_objects():  # the suite's process holds ~400,000 objects add_index's collection skips
            merged.add_index(part_prefix)
    merged.finalize(prefix + ".idx")
    return prefix


def _megatron_lm_sentences(split, text):
    """The sentences Megatron-LM's `--split-sentences` step writes for `text`: `split`'s, over
    1,000,000-character chunks; an empty text has no chunk, so no sentence."""
    return [s for i in range(0, len(text), 1_000_000) for s in split(text[i : i + 1_000_000])]


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
    _assert_same_bytes(out, reference)
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus_text_document.bin", "corpus_text_document.idx",
                                                   "corpus_text_document.tokens.json"]


def _assert_same_bytes(prefix, reference):
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "rb") as a, open(reference + suffix, "rb") as b:
            assert a.read() == b.read(), suffix


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
    # Multi-sentence documents are byte-identical to Megatron-LM's, which tokenizes each sentence
    # of its `{"text": [sentences]}` lines and adds them as one document.
    reference = _megatron_lm_reference(
        tokenizer, [splitter.split(t) for t in assets.texts], str(tmp_path / "reference"), False, 1,
        DType.optimal_dtype(tokenizer.vocab_size),
    )
    _assert_same_bytes(out, reference)


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


def test_last_word_is_the_non_whitespace_run_a_regex_finds():
    """The splitter's word before a `.`: what `(\\S+)\\Z` matches in the text up to it, Unicode spaces included."""
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab.( \n\t\u00a0\u2003") for _ in range(rng.randint(0, 12)))
        end = rng.randint(0, len(text))
        match = re.search(r"(\S+)\Z", text[:end])
        assert last_word(text, end) == (match.group(1) if match else ""), (text, end)


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
    "empty document": json.dumps({"text": ""}).encode() + b"\n",  # bad input with --reject-empty only
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
        preprocess(_null_config(path, tmp_path / "out", reject_empty=True))
    assert _no_outputs(tmp_path)


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_skip_invalid_skips_and_counts(tmp_path, reason):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 7 + BAD_LINES[reason] + GOOD * 5)
    report = preprocess(_null_config(path, tmp_path / "out", skip_invalid=True, reject_empty=True))
    assert report.skipped == {reason: 1} and report.documents == 12
    assert _read_documents(str(tmp_path / "out_text_document")) == [[[1, 2, 3]]] * 12
    assert f"skipped 1 lines (1 {reason})" in report.summary()


def test_an_empty_document_is_written_and_counted_like_megatron_lm(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD + BAD_LINES["empty document"] + GOOD)
    report = preprocess(_null_config(path, tmp_path / "out", append_eod=True))
    # Megatron-LM adds it with no sequence, and no eod: eod only ends a document that has tokens.
    assert _read_documents(str(tmp_path / "out_text_document")) == [[[1, 2, 3, 100]], [], [[1, 2, 3, 100]]]
    assert report.documents == 3 and report.empty_documents == 1 and not report.skipped
    assert "; 1 empty documents;" in report.summary()


def test_reject_empty_names_the_line_through_the_command_line(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD + BAD_LINES["empty document"] + GOOD)
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--workers", "2", "--reject-empty"]
    assert main(argv) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"megatron-patch preprocess-data: error: {path}:2: empty document: no tokens in 'text' (refused by "
        "--reject-empty; without it the line is written as an empty document, as Megatron-LM does)"
    )
    assert _no_outputs(tmp_path)
    with pytest.raises(SystemExit):
        main(argv + ["--keep-empty"])
    assert "--keep-empty: not allowed with argument --reject-empty" in capsys.readouterr().err


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


def test_lone_surrogate_is_a_tokenizer_error_naming_the_line(assets, tmp_path):
    path = tmp_path / "in.jsonl"
    # An unpaired JSON escape decodes to a lone surrogate: valid JSON, but no UTF-8 bytes for the BPE to encode.
    path.write_bytes(GOOD * 7 + b'{"text": "x \\ud800 y"}\n' + GOOD * 5)
    config = PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "out"), workers=2, batch_lines=3,
                              tokenizer_type="GPT2BPETokenizer", tokenizer_options=assets.options["GPT2BPETokenizer"])
    with pytest.raises(InputError, match=r"in.jsonl:8: tokenizer error: text holds the lone surrogate"):
        preprocess(config)
    assert _no_outputs(tmp_path)


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
    with pytest.raises(UserError, match=r"^worker process \d+ exited with status 9; nothing was written"):
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


_GPT2_FILES = ["--vocab-file", "{vocab_file}", "--merge-file", "{merge_file}"]
# name -> (tokenizer type, flags, how Megatron-LM cuts a text into sequences, --append-eod, --partitions, level).
# With --split-sentences Megatron-LM first writes each partition as `{"text": [sentences]}` lines
# (whitespace kept with --keep-newlines), then tokenizes each sentence.
CLI_CASES = {
    "sentencepiece-sentences": (
        "SentencePieceTokenizer",
        ["--tokenizer-model", "{tokenizer_model}", "--split-sentences", "--keep-newlines", "--partitions", "2"],
        SentenceSplitter(keep_newlines=True).split, False, 2, "sentence",
    ),
    "gpt2-documents": ("GPT2BPETokenizer", [*_GPT2_FILES, "--append-eod", "--partitions", "3"],
                       lambda text: [text], True, 3, "document"),
    # GPT-2 BPE keeps whitespace (SentencePiece's normalizer drops it), so these bytes show that
    # --keep-newlines reaches the splitter.
    "gpt2-sentences-keep-newlines": (
        "GPT2BPETokenizer", [*_GPT2_FILES, "--append-eod", "--split-sentences", "--keep-newlines", "--partitions", "2"],
        SentenceSplitter(keep_newlines=True).split, True, 2, "sentence",
    ),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_command_line_tool_writes_megatron_lm_bytes(assets, tmp_path, case):
    tokenizer_type, flags, split, append_eod, partitions, level = CLI_CASES[case]
    if level == "sentence":
        split = functools.partial(_megatron_lm_sentences, split)
    options = assets.options[tokenizer_type]
    # Real corpora have documents without tokens, which Megatron-LM writes as empty documents and
    # goes on: an empty text, first and last too, and whitespace (no sentence to split it into).
    texts = list(assets.texts)
    for position, text in [(0, ""), (7, ""), (8, ""), (50, " \n\n  "), (len(texts) + 4, "")]:
        texts.insert(position, text)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    prefix = str(tmp_path / "out" / "corpus")
    command = [sys.executable, os.path.join(ROOT, "toolkits", "preprocess_data.py"), "--input", str(corpus),
               "--output-prefix", prefix, "--tokenizer-type", tokenizer_type, "--json-keys", "text",
               "--workers", "2", *(flag.format(**options) for flag in flags)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = f"{prefix}_text_{level}"
    assert sorted(os.listdir(tmp_path / "out")) == [f"corpus_text_{level}.bin", f"corpus_text_{level}.idx",
                                                   f"corpus_text_{level}.tokens.json"]

    tokenizer = build_tokenizer(tokenizer_type, **options)
    documents = [split(t) for t in texts]
    reference = _megatron_lm_reference(
        tokenizer, documents, str(tmp_path / "reference"), append_eod, partitions,
        DType.optimal_dtype(tokenizer.vocab_size),
    )
    _assert_same_bytes(out, reference)
    empty = sum(not any(tokenizer.tokenize(s) for s in sentences) for sentences in documents)
    assert empty >= 4 and f"Done: {len(texts)} documents" in result.stderr
    assert f"; {empty} empty documents;" in result.stderr


def test_keep_newlines_keeps_the_whitespace_between_sentences(assets, tmp_path):
    # GPT-2 BPE is byte-level, so the whitespace of a sentence survives tokenization (a
    # SentencePiece model's normalizer would drop it and hide the flag's effect).
    options = assets.options["GPT2BPETokenizer"]
    tokenizer = build_tokenizer("GPT2BPETokenizer", **options)
    sentences = {}
    for keep_newlines in (False, True):
        prefix = str(tmp_path / f"keep{keep_newlines}")
        report = preprocess(PreprocessConfig(
            input=assets.corpus, output_prefix=prefix, tokenizer_type="GPT2BPETokenizer", tokenizer_options=options,
            split_sentences=True, keep_newlines=keep_newlines, workers=2,
        ))
        documents = _read_documents(report.outputs[0])
        sentences[keep_newlines] = [[tokenizer.detokenize(s) for s in doc] for doc in documents]
    kept, stripped = sentences[True], sentences[False]
    # Kept: the sentences of a document are consecutive slices of it, whitespace and all.
    assert ["".join(doc) for doc in kept] == assets.texts
    assert sum(s.endswith("\n") for doc in kept for s in doc) > len(assets.texts)
    # Not kept: the same sentences without the whitespace around them.
    assert stripped == [[s.strip() for s in doc] for doc in kept]
    assert not any(s != s.strip() for doc in stripped for s in doc)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


_FIELDS = re.compile(r"(\d+) docs \| ([\d.]+) MB/s \| ([\d.]+)M tok/s \| (\d+)% \| ETA (\d+):(\d\d):(\d\d)")


def _fields(line):
    """(documents, MB/s, M tokens/s, percent, ETA seconds) parsed from a progress line."""
    docs, mb_s, tok_s, percent, h, m, s = _FIELDS.fullmatch(line).groups()
    return int(docs), float(mb_s), float(tok_s), int(percent), 3600 * int(h) + 60 * int(m) + int(s)


@pytest.fixture
def clock(monkeypatch):
    """A settable clock for progress.py: `clock[0] = 12.0`."""
    now = [100.0]
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def test_progress_on_a_terminal_redraws_one_line(clock):
    stream = _Terminal()
    progress = Progress(total_bytes=40_000_000, log_interval=1, stream=stream, refresh_s=0.25)
    # (time, documents, input bytes, tokens, position); the 2nd comes too soon after the 1st to be drawn.
    updates = [(102.0, 500, 10_000_000, 4_000_000, 10_000_000), (102.1, 600, 11_000_000, 4_400_000, 11_000_000),
               (104.0, 1000, 20_000_000, 8_000_000, 30_000_000)]
    for now, *values in updates:
        clock[0] = now
        progress.update(*values)
    progress.close("Done: 1000 documents")
    output = stream.getvalue()
    # Every frame starts by returning to the line start and clearing it; no line ends before the summary.
    assert output.endswith("\r\x1b[KDone: 1000 documents\n") and output.count("\n") == 1
    frames = output[: -len("Done: 1000 documents\n")].split("\r\x1b[K")
    assert frames[0] == "" and frames[-1] == ""
    drawn = [_fields(frame) for frame in frames[1:-1]]
    expected = []
    for now, documents, input_bytes, tokens, position in (updates[0], updates[2]):
        elapsed, fraction = now - 100.0, position / 40_000_000
        expected.append((documents, input_bytes / elapsed / 1e6, tokens / elapsed / 1e6, 100 * fraction,
                         elapsed / fraction - elapsed))
    assert len(drawn) == len(expected)
    for got, want in zip(drawn, expected):
        assert got[0] == want[0] and got[3] == round(want[3])
        assert got[1] == pytest.approx(want[1], abs=0.05) and got[2] == pytest.approx(want[2], abs=0.005)
        assert abs(got[4] - want[4]) <= 1


def test_preprocess_on_a_terminal_draws_progress_in_place(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 30)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    preprocess(_null_config(path, tmp_path / "out", log_interval=10))
    output = terminal.getvalue()
    # At least the first update is drawn; the summary is the only line that ends.
    frames, summary = output.rsplit("\r\x1b[K", 1)
    assert frames.startswith("\r\x1b[K") and _fields(frames.split("\r\x1b[K")[1])[0] > 0
    assert summary.startswith("Done: 30 documents") and output.count("\n") == 1 and output.endswith("\n")


def test_progress_in_a_log_prints_a_line_per_interval(clock):
    stream = io.StringIO()
    progress = Progress(total_bytes=1000, log_interval=10, stream=stream)
    for documents in (5, 12, 18, 25, 31, 40):
        clock[0] += 1
        progress.update(documents, 10 * documents, 20 * documents, 10 * documents)
    progress.close("Done: 40 documents")
    lines = stream.getvalue().split("\n")
    assert lines[-1] == "" and lines[-2] == "Done: 40 documents"
    # A line each time the count passes a multiple of 10, as Megatron-LM's --log-interval; no terminal codes.
    assert [_fields(line)[0] for line in lines[:-2]] == [12, 25, 31, 40]
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_interrupted_run_leaves_no_outputs_and_keeps_previous_ones(tmp_path, monkeypatch):
    path = tmp_path / "in.jsonl"
    path.write_bytes(GOOD * 10)
    preprocess(_null_config(path, tmp_path / "out", partitions=2))
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if n.startswith("out")}
    assert sorted(before) == ["out_text_document.bin", "out_text_document.idx", "out_text_document.tokens.json"]
    path.write_bytes(GOOD * 100)

    # Ctrl-C arrives while reading the 9th batch, after earlier batches were written to temporary files.
    writes, at_interrupt = [], []
    real_write, real_read = preprocess_module._write, preprocess_module._read_batches

    def counting_write(*args):
        writes.append(1)
        real_write(*args)

    def interrupted_read(paths, config):
        for count, batch in enumerate(real_read(paths, config)):
            if count == 8:
                at_interrupt.extend([len(writes), sorted(glob.glob(str(tmp_path / "*.tmp-*")))])
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(preprocess_module, "_write", counting_write)
    monkeypatch.setattr(preprocess_module, "_read_batches", interrupted_read)
    for prefix in ("out", "fresh"):
        writes.clear()
        at_interrupt.clear()
        with pytest.raises(KeyboardInterrupt):
            preprocess(_null_config(path, tmp_path / prefix, partitions=2))
        assert at_interrupt[0] > 0 and at_interrupt[1], "the run was not interrupted mid-way"
    after = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if n != "in.jsonl"}
    assert after == before
