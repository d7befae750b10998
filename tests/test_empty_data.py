"""Data that gives no training samples stops ``megatron-patch train`` before its first step with a line naming
the --data-path prefix and the fix; whether a BERT split has samples is megatron-core's own answer."""

import json
import os
import subprocess
import sys
import types

import numpy
import pytest
import torch

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "2", "--lr", "1e-3", "--split", "100,0,0", "--log-interval", "1"]


def megatron_patch(*argv, timeout=300):
    """``megatron-patch ARGV`` in a subprocess: (exit status, stdout and stderr)."""
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def preprocess(tmp_path, name, texts, *flags):
    """``megatron-patch preprocess-data`` of ``texts`` (one JSONL document each); the --data-path prefix."""
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    status, output = megatron_patch("preprocess-data", "--input", str(corpus), "--output-prefix",
                                    str(tmp_path / name), *flags)
    assert status == 0, output
    return str(tmp_path / f"{name}_text_{'sentence' if '--split-sentences' in flags else 'document'}")


def assert_refused(status, output, prefix, fix):
    """A failed run whose report has a line naming ``prefix`` and ``fix``, and no training step."""
    assert status != 0, output
    lines = [line for line in output.splitlines() if f"--data-path {prefix}:" in line]
    assert lines and fix in lines[-1], output
    assert " iteration " not in output and "cannot mmap" not in output, output
    assert "Traceback" not in output, output  # one line; the traceback only with --debug


def test_an_empty_dataset_is_refused_before_the_first_step(tmp_path):
    prefix = preprocess(tmp_path, "empty", [], "--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    assert os.path.getsize(prefix + ".bin") == 0
    status, output = megatron_patch("train", "--task", "pretraining", "--nproc-per-node", "1", *MODEL,
                                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path", prefix)
    assert_refused(status, output, prefix, "preprocess-data")


def test_bert_data_without_a_sentence_pair_is_refused_before_the_first_step(tmp_path):
    """The next-sentence head needs documents of two sentences: one-sentence documents give no sample (and
    megatron-core spent 2**31 epochs finding that out)."""
    from transformers import BertConfig, BertForPreTraining

    words = [f"w{i}" for i in range(40)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *words]) + "\n")
    BertForPreTraining(BertConfig(vocab_size=len(words) + 6, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32)).save_pretrained(str(tmp_path / "bert"))
    tokenizer = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab)]
    texts = [" ".join(words[i:i + 8]) + "." for i in range(0, 32, 2)]
    prefix = preprocess(tmp_path, "one_sentence", texts, *tokenizer, "--split-sentences")
    status, output = megatron_patch("train", "--task", "pretraining", "--nproc-per-node", "1", *MODEL, *tokenizer,
                                    "--pretrained-model-name-or-path", str(tmp_path / "bert"), "--data-path", prefix)
    assert_refused(status, output, prefix, "--split-sentences")


@pytest.mark.parametrize("binary_head", [True, False])
def test_whether_a_bert_split_has_samples_is_megatron_cores_answer(tmp_path, binary_head):
    """``_yields_samples`` against megatron-core's ``build_mapping`` (the sample index itself) on random
    documents of 0-3 sentences, some longer than megatron-core's long-sentence limit, read in chunks of 2."""
    from megatron_patch import compat

    compat.apply()
    from megatron.core.datasets import helpers
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from megatron_patch.data.datasets import BERTMaskedWordPieceDataset, _yields_samples

    rng = numpy.random.default_rng(0)
    config = types.SimpleNamespace(classification_head=binary_head)
    answers = []
    for trial in range(60):
        path = str(tmp_path / f"docs{trial}")
        builder = IndexedDatasetBuilder(path + ".bin", dtype=numpy.int32)
        documents = int(rng.integers(1, 5))
        for _ in range(documents):
            lengths = [int(rng.choice([3, 600])) for _ in range(int(rng.integers(0, 4)))]
            builder.add_document(torch.ones(sum(lengths), dtype=torch.int32), lengths)
        builder.add_document(torch.ones(1, dtype=torch.int32), [1])  # a non-empty .bin; outside the range checked
        builder.finalize(path + ".idx")
        data = IndexedDataset(path)
        mapping = helpers.build_mapping(data.document_indices[:documents + 1], data.sequence_lengths, 3, 100, 64,
                                        0.1, 1, False, 2 if binary_head else 1)
        answer = _yields_samples(BERTMaskedWordPieceDataset, config, data, 0, documents, chunk=2)
        assert answer == (mapping.shape[0] > 0), (data.document_indices, data.sequence_lengths)
        answers.append(answer)
    assert any(answers) and not all(answers)
