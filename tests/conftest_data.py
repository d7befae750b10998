"""Shared test data: a small stdlib corpus and tokenizers trained on it, built once per session.

    from conftest_data import data_assets
    assets = data_assets(tmp_path_factory)
    tok = build_tokenizer("GPT2BPETokenizer", **assets.options["GPT2BPETokenizer"])
"""

import csv
import json
import os
from dataclasses import dataclass

import regex

from megatron_patch.data.corpus import write_stdlib_corpus
from megatron_patch.data.train_tokenizer import train_tokenizer

# Hand-written documents that the stdlib lacks: accents, CJK, emoji, control characters,
# sentences, a literal special token, and long runs of whitespace.
EXTRA_DOCUMENTS = [
    "Héllo wörld! Ça va? Dr. Smith met Mr. J. Doe at 5 p.m. in the U.S. They talked.\n\nNew paragraph here.",
    "中文文本，日本語のテキスト。 Emoji: 🙂🚀 and math ∑x² ≤ ∞.",
    "Tabs\tand\u00a0non-breaking\u2028separators\x0bvertical\x0cform feed; <|endoftext|> and [SEP] <SEP> <s> literal.",
    "   leading spaces, trailing spaces   \n\n\n   and blank lines   ",
    "ALL CAPS SENTENCE. Another one! A third? Yes... Done.",
]


@dataclass
class DataAssets:
    corpus: str  # JSONL, one {"text": ...} per line
    texts: list[str]
    options: dict[str, dict]  # tokenizer type -> build_tokenizer keyword arguments


_CACHE: dict[str, DataAssets] = {}


def data_assets(tmp_path_factory) -> DataAssets:
    """Build (once per session) the corpus and a tokenizer of every registered type."""
    if "assets" in _CACHE:
        return _CACHE["assets"]
    root = str(tmp_path_factory.mktemp("data_assets"))
    corpus = os.path.join(root, "corpus.jsonl")
    write_stdlib_corpus(corpus, max_docs=200, max_doc_chars=1500)
    with open(corpus, "a", encoding="utf-8") as f:
        for text in EXTRA_DOCUMENTS:
            f.write(json.dumps({"text": text}) + "\n")
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    for kind in ("gpt2-bpe", "wordpiece", "sentencepiece", "huggingface"):
        train_tokenizer(kind, corpus, os.path.join(root, kind), vocab_size=1000)
    wordpiece = {"vocab_file": os.path.join(root, "wordpiece", "vocab.txt")}
    sentencepiece = {"tokenizer_model": os.path.join(root, "sentencepiece", "tokenizer.model")}
    options = {
        "GPT2BPETokenizer": {
            "vocab_file": os.path.join(root, "gpt2-bpe", "vocab.json"),
            "merge_file": os.path.join(root, "gpt2-bpe", "merges.txt"),
        },
        "BertWordPieceLowerCase": wordpiece,
        "BertWordPieceCase": wordpiece,
        "SentencePieceTokenizer": sentencepiece,
        "GPTSentencePieceTokenizer": sentencepiece,
        "Llama2Tokenizer": sentencepiece,
        "HuggingFaceTokenizer": {"tokenizer_model": os.path.join(root, "huggingface")},
        "NullTokenizer": {"vocab_size": 1000},
    }
    _CACHE["assets"] = DataAssets(corpus=corpus, texts=texts, options=options)
    return _CACHE["assets"]


def write_pairs_jsonl(tsv_dir: str, out_dir: str) -> str:
    """The rows of MRPC's ``train.tsv``/``dev.tsv`` in ``tsv_dir`` as JSONL (``out_dir/{train,dev}.jsonl``, one
    ``{"sentence1", "sentence2", "label"}`` per line), the other layout ``--task sequence_classification`` reads.

        write_pairs_jsonl(os.path.join(assets.glue_dir, "mrpc"), os.path.join(root, "mrpc_jsonl"))
    """
    os.makedirs(out_dir, exist_ok=True)
    for split in ("train", "dev"):
        with open(os.path.join(tsv_dir, f"{split}.tsv"), encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
        with open(os.path.join(out_dir, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"sentence1": row["#1 String"], "sentence2": row["#2 String"],
                                    "label": int(row["Quality"])}) + "\n")
    return out_dir


def write_null_corpus(path: str, texts: list[str]) -> list[str]:
    """NullTokenizer input made from `texts`: each document becomes its code points mod 1000."""
    docs = [" ".join(str(ord(c) % 1000) for c in text[:300]) for text in texts]
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return docs


class ReferenceGPT2BPE:
    """GPT-2's published byte-level BPE in plain Python, the algorithm Megatron-LM's
    `gpt2_tokenization.py` runs: the oracle for GPT2BPETokenizer and the benchmark's baseline."""

    PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_file, merge_file):
        with open(vocab_file, encoding="utf-8") as f:
            self.vocab = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        others = [b for b in range(256) if b not in printable]
        self.byte_symbol = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
        self.cache: dict[str, list[int]] = {}  # per pre-token, as Megatron-LM's tokenizer keeps

    def bpe(self, symbols):
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def encode(self, text):
        ids = []
        for piece in self.PATTERN.findall(text):
            if piece not in self.cache:
                symbols = [self.byte_symbol[b] for b in piece.encode("utf-8")]
                self.cache[piece] = [self.vocab[s] for s in self.bpe(symbols)]
            ids += self.cache[piece]
        return ids
