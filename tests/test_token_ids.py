"""A start checks its data's token ids against the tokenizer once: from the largest id ``preprocess-data`` records
next to the .idx (``PREFIX.tokens.json``) when that still describes the .bin, else by reading the .bin once (data
Megatron-LM wrote), the launcher's reading handed to its ranks."""

import json
import os
import subprocess
import sys
import time

import numpy
import pytest

from megatron_patch.data import data_path
from megatron_patch.data.data_path import DataError, check_token_ids
from megatron_patch.data.preprocess import PreprocessConfig, preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = [[(7 * i + j) % 90 + 1 for j in range(40)] for i in range(20)]  # ids 1..90


@pytest.fixture(autouse=True)
def reads(monkeypatch):
    """The .bin files read in full, by prefix; the launcher's readings of an earlier test not in the environment."""
    monkeypatch.setenv("MEGATRON_PATCH_LARGEST_TOKEN_IDS", "{}")
    read, original = [], data_path._read_largest
    monkeypatch.setattr(data_path, "_read_largest", lambda prefix: read.append(prefix) or original(prefix))
    return read


def _preprocessed(tmp_path) -> str:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(map(str, doc))}) + "\n" for doc in DOCUMENTS))
    preprocess(PreprocessConfig(input=str(corpus), output_prefix=str(tmp_path / "corpus"),
                                tokenizer_type="NullTokenizer", tokenizer_options={"vocab_size": 100}, workers=1))
    return str(tmp_path / "corpus_text_document")


def _megatron_lm_data(prefix: str) -> str:
    """``prefix.bin``/``.idx`` written by megatron-core's own builder, as Megatron-LM's preprocess_data.py does:
    no record."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for tokens in DOCUMENTS:
        builder.add_document(torch.tensor(tokens), [len(tokens)])
    builder.finalize(prefix + ".idx")
    return prefix


def test_preprocess_records_the_largest_id_and_a_start_reads_no_bin(tmp_path, reads):
    prefix = _preprocessed(tmp_path)
    with open(prefix + ".tokens.json") as f:
        record = json.load(f)
    assert record["version"] == 1 and record["largest_token_id"] == 90
    reads.clear()  # preprocess's own reading, which made the record
    check_token_ids([prefix], 91)
    with pytest.raises(DataError, match=f"--data-path {prefix}: {prefix}.bin holds token id 90, beyond this "
                                        "tokenizer's 90 tokens"):
        check_token_ids([prefix], 90)
    assert reads == []


def test_data_without_a_record_is_read_once_per_start_and_not_again_by_the_ranks(tmp_path, reads):
    prefix = _megatron_lm_data(str(tmp_path / "megatron_lm_text_document"))
    check_token_ids([prefix], 100)  # the launcher's check
    check_token_ids([prefix], 100)
    assert reads == [prefix]
    # A rank: torchrun hands it the launcher's environment. Reading the .bin there fails the check.
    rank = ("import sys; from megatron_patch.data import data_path\n"
            "data_path._read_largest = lambda prefix: sys.exit(f'{prefix}.bin read again')\n"
            f"data_path.check_token_ids([{prefix!r}], 100)\n")
    done = subprocess.run([sys.executable, "-c", rank], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("change", ["rewritten", "grown", "record of another version", "record cut short",
                                    "read by the launcher, then rewritten"])
def test_a_record_or_reading_that_no_longer_describes_the_bin_is_not_trusted(tmp_path, reads, change):
    if change.startswith("read"):
        prefix = _megatron_lm_data(str(tmp_path / "megatron_lm_text_document"))
    else:
        prefix = _preprocessed(tmp_path)
    check_token_ids([prefix], 100)
    bin_file, record = prefix + ".bin", prefix + ".tokens.json"
    tokens = numpy.fromfile(bin_file, dtype=numpy.uint16)
    tokens[7] = 99  # another tokenizer's id
    time.sleep(0.05)  # a rewrite the clock tells from the recorded one (the .bin's modification time)
    if change == "grown":
        numpy.concatenate([tokens, tokens[:3]]).tofile(bin_file)
    else:  # the same size
        tokens.tofile(bin_file)
    if change == "record of another version":
        with open(record) as f:
            other = {**json.load(f), "version": 2, "bin": data_path._bin_identity(prefix)}
        with open(record, "w") as f:
            json.dump(other, f)
    elif change == "record cut short":
        os.truncate(record, 10)
    reads.clear()
    with pytest.raises(DataError, match="holds token id 99, beyond this tokenizer's 95 tokens"):
        check_token_ids([prefix], 95)
    assert reads == [prefix]
