"""Tiny random stand-ins for the inputs the README's steps take as yours, made from the Python standard library's
sources with nothing downloaded, so that every step runs on a fresh machine:

    megatron-patch make-stand-ins --output-dir .

writes, under ``--output-dir``:
- ``hf/qwen2``: a Qwen2 chat model (2 layers, hidden size 32, random weights) with a byte-level BPE tokenizer of
  1000 tokens trained on the corpus, ChatML's special tokens and Qwen2-Instruct's chat template;
- ``data/glue/mrpc/{train,dev}.tsv``: a task in MRPC's columns whose label a tiny model learns in a few epochs;
- ``data/chat.jsonl``: 80 conversations in OpenAI's ``{"messages": [...]}`` form;
- ``data/prefs.jsonl``: 64 preference pairs in TRL's conversational form (``prompt``, ``chosen``, ``rejected``);
- ``llama2/tokenizer.model``: a SentencePiece tokenizer, and ``data/llama_text_document`` preprocessed with it.

A path that exists is kept as it is and named (a model of yours at ``hf/qwen2`` is never replaced).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile

from megatron_patch.errors import FlagParser
from megatron_patch.staging import killed_leftovers, staging_tag, tag_pattern

# Qwen2's embedding rows for the 1000-token tokenizer: a multiple of 128 x TP 2, so megatron-core pads nothing.
QWEN2_VOCAB = 1024
_WORDS = ("the quick brown fox jumps over a lazy dog with list of keys and values in python code return yield "
          "import class def self none true false").split()


def conversations(count: int, seed: int, turns: int = 2, words: int = 5) -> list[dict]:
    """``count`` OpenAI ``messages`` rows: a system turn in about half, then 1 to ``turns`` user/assistant pairs of
    1 to ``words`` words each.

    Example::

        conversations(1, seed=0)   # [{'messages': [{'role': 'user', 'content': 'fox the'}, {'role': ...}]}]
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": " ".join(rng.choices(_WORDS, k=rng.randint(2, words)))})
        for _ in range(rng.randint(1, turns)):
            messages.append({"role": "user", "content": " ".join(rng.choices(_WORDS, k=rng.randint(2, words)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(_WORDS, k=rng.randint(1, words)))})
        rows.append({"messages": messages})
    return rows


def preference_pairs(count: int, seed: int) -> list[dict]:
    """``count`` pairs in TRL's conversational form with an explicit prompt: the chosen answer opens with "yes",
    the rejected one with "no" (a preference a model learns in a few steps), both a few words long.

    Example::

        preference_pairs(1, seed=0)   # [{'prompt': [{'role': 'user', ...}], 'chosen': [...], 'rejected': [...]}]
    """
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choices(_WORDS, k=k))

    return [{"prompt": [{"role": "user", "content": words(rng.randint(2, 5))}],
             "chosen": [{"role": "assistant", "content": "yes " + words(rng.randint(1, 5))}],
             "rejected": [{"role": "assistant", "content": "no " + words(rng.randint(1, 5))}]} for _ in range(count)]


def write_jsonl(path: str, rows: list[dict]) -> str:
    """Example: ``write_jsonl("data/chat.jsonl", conversations(80, seed=0))``."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_glue(task_dir: str, seed: int = 0) -> None:
    """MRPC's TSV layout (``task_dir/{train,dev}.tsv``) with a label a tiny model learns in a few dozen steps: 1
    when the first sentence opens with one of three keywords, 0 with one of three others (whole words of a
    WordPiece vocabulary trained on code; a keyword anywhere in the sentence took a random-init 2-layer BERT far
    longer).

    Example::

        write_glue("data/glue/mrpc")   # train.tsv (256 pairs), dev.tsv (64)
    """
    rng = random.Random(seed)
    keywords = ["return", "yield", "raise", "import", "class", "def"]
    fillers = ["the", "self", "value", "name", "data", "list", "key", "new", "for", "if", "while", "with"]
    os.makedirs(task_dir, exist_ok=True)
    for split, count in (("train", 256), ("dev", 64)):
        with open(os.path.join(task_dir, f"{split}.tsv"), "w") as f:
            f.write("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n")
            for i in range(count):
                a, b = rng.choice(keywords), rng.choice(keywords)
                s1 = " ".join([a] + rng.sample(fillers, 5))
                s2 = " ".join(rng.sample(fillers, 2) + [b] + rng.sample(fillers, 3))
                f.write(f"{int(keywords.index(a) < 3)}\t{i}\t{i + 10000}\t{s1}\t{s2}\n")


def _qwen2(directory: str, corpus: str) -> None:
    import torch
    import transformers

    from megatron_patch.data.jsonl import iter_jsonl_texts
    from megatron_patch.data.train_tokenizer import train_chatml

    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=QWEN2_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(directory)
    train_chatml(iter_jsonl_texts([corpus]), directory, 1000)


def _llama(directory: str, corpus: str, prefix: str) -> None:
    from megatron_patch.data.jsonl import iter_jsonl_texts
    from megatron_patch.data.preprocess import PreprocessConfig, preprocess
    from megatron_patch.data.train_tokenizer import train_sentencepiece

    os.makedirs(directory)
    train_sentencepiece(iter_jsonl_texts([corpus]), directory, 1000)
    preprocess(PreprocessConfig(input=corpus, output_prefix=prefix, tokenizer_type="Llama2Tokenizer",
                                tokenizer_options={"tokenizer_model": os.path.join(directory, "tokenizer.model")},
                                append_eod=True))


def make_stand_ins(output_dir: str, corpus: str | None = None) -> list[str]:
    """Write the stand-ins that do not exist yet under ``output_dir`` (each under a temporary name, then renamed);
    the lines that say what was written or kept.

    Example::

        make_stand_ins(".")   # ['wrote ./hf/qwen2: a random Qwen2 chat model with a ChatML tokenizer', ...]
    """
    from megatron_patch.data.corpus import write_stdlib_corpus

    data = os.path.join(output_dir, "data")
    stand_ins = [
        (os.path.join(output_dir, "hf", "qwen2"), "a random Qwen2 chat model with a ChatML tokenizer",
         lambda d: _qwen2(d, corpus)),
        (os.path.join(data, "glue", "mrpc"), "a task in MRPC's columns", write_glue),
        (os.path.join(data, "chat.jsonl"), "80 conversations", lambda f: write_jsonl(f, conversations(80, seed=0))),
        (os.path.join(data, "prefs.jsonl"), "64 preference pairs",
         lambda f: write_jsonl(f, preference_pairs(64, seed=0))),
        (os.path.join(output_dir, "llama2"), f"a SentencePiece tokenizer; {data}/llama_text_document is preprocessed "
         "with it", lambda d: _llama(d, corpus, os.path.join(data, "llama"))),
    ]
    lines = []
    with tempfile.TemporaryDirectory() as scratch:
        if corpus is None:
            corpus = os.path.join(scratch, "corpus.jsonl")
            write_stdlib_corpus(corpus, max_docs=200, max_doc_chars=1500)
        for target, what, write in stand_ins:
            if os.path.exists(target):
                lines.append(f"kept {target}: it exists (a stand-in never replaces it)")
                continue
            parent, name = os.path.split(target)
            os.makedirs(parent, exist_ok=True)
            # What a killed run left of this stand-in goes, as the other commands' staging does (staging.py).
            leftovers = [path for path, _, _ in killed_leftovers(parent, re.escape(name) + tag_pattern("partial"))]
            partial = target + staging_tag("partial")
            try:
                write(partial)
                os.replace(partial, target)
            finally:
                for path in (*leftovers, partial):
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
            lines.append(f"wrote {target}: {what}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description="Tiny random stand-ins for the README's inputs: hf/qwen2, data/glue/mrpc, "
                                    "data/chat.jsonl, data/prefs.jsonl, llama2/tokenizer.model (nothing downloaded; "
                                    "existing paths kept)")
    parser.add_argument("--output-dir", default=".", help="where hf/, data/ and llama2/ go (default: here)")
    parser.add_argument("--corpus", help="a JSONL corpus ({\"text\": ...} per line) to train the tokenizers on "
                                         "(default: 200 pieces of the Python standard library's sources)")
    args = parser.parse_args(argv)
    if args.corpus is not None and not os.path.isfile(args.corpus):
        parser.error(f"--corpus {args.corpus}: no such file; make one with megatron-patch make-corpus --output "
                     f"{args.corpus} or leave --corpus out")
    for line in make_stand_ins(args.output_dir, args.corpus):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
