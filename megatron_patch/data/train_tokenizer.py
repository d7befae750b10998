"""Train a tokenizer from a JSONL corpus, so that nothing has to be downloaded.

    megatron-patch train-tokenizer --kind gpt2-bpe --input stdlib.jsonl --output-dir tok --vocab-size 8000

(`python toolkits/train_tokenizer.py` takes the same flags.) It lives in `data/`, beside `corpus` and `preprocess`,
because it reads JSONL through `data.jsonl`: `data/` builds on `tokenizer/`, and the runtime tokenizers import
nothing from `data/`.

Kinds and what they write into `--output-dir` (and the `--tokenizer-type` that reads it):
- `gpt2-bpe`: `vocab.json` + `merges.txt`, byte-level BPE with `<|endoftext|>` (GPT2BPETokenizer)
- `wordpiece`: `vocab.txt` with `[PAD] [UNK] [CLS] [SEP] [MASK]` (BertWordPieceLowerCase, or
  BertWordPieceCase with `--cased`)
- `sentencepiece`: `tokenizer.model` (SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer)
- `huggingface`: a transformers tokenizer directory, byte-level BPE with `<|endoftext|>` as
  bos/eos and `<pad>` (HuggingFaceTokenizer)
- `chatml`: the same with ChatML's `<|im_start|>`/`<|im_end|>` and Qwen2-Instruct's chat template, for
  `preprocess-data --sft` (HuggingFaceTokenizer)
"""

import os
from typing import Callable, Iterable, Iterator

from megatron_patch.data.jsonl import expand_inputs, iter_jsonl_texts
from megatron_patch.errors import FlagParser
from megatron_patch.tokenizer.gpt2 import EOD_TOKEN

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _train_byte_level_bpe(texts: Iterator[str], vocab_size: int, special_tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        # Every byte gets a token, so any text can be encoded (as in GPT-2).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def train_gpt2_bpe(texts: Iterator[str], output_dir: str, vocab_size: int) -> list[str]:
    tokenizer = _train_byte_level_bpe(texts, vocab_size, [EOD_TOKEN])
    return tokenizer.model.save(output_dir)  # vocab.json, merges.txt


def train_wordpiece(texts: Iterable[str], output_dir: str, vocab_size: int, lower_case: bool = True) -> list[str]:
    """A WordPiece ``vocab.txt``, the same file for the same texts every time.

    The tokenizers library's trainer numbers the word-continuing pieces (``##e``) in the order it meets them in a
    hash map, which changes from run to run, and breaks ties between equally frequent merges by those numbers: the
    same corpus gave another ``vocab.txt`` each time, and 20 runs on the test corpus gave 3 different sets of tokens
    (huggingface/tokenizers issue 1794, checked on 0.23.3). So a first pass stops before any merge and finds
    those pieces, and the real pass is given them, sorted, with the special tokens, which the trainer numbers first
    in the order given. ``texts`` is read twice (an iterator is listed first).
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if iter(texts) is texts:
        texts = list(texts)

    def train(vocab_size: int, special_tokens: list[str]) -> Tokenizer:
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=lower_case)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                            show_progress=False)
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return tokenizer

    # Without merges the vocabulary is the special tokens, the alphabet and the continuing pieces of its characters.
    continuing = sorted(token for token in train(0, BERT_SPECIAL_TOKENS).get_vocab()
                        if token.startswith("##") and len(token) == 3)
    return train(vocab_size, BERT_SPECIAL_TOKENS + continuing).model.save(output_dir)  # vocab.txt


def train_sentencepiece(texts: Iterator[str], output_dir: str, vocab_size: int) -> list[str]:
    import sentencepiece

    def lines() -> Iterator[str]:
        # SentencePiece trains on sentences of at most 4192 bytes and drops longer ones, so
        # documents are fed line by line.
        for text in texts:
            yield from (line for line in text.split("\n") if line.strip())

    prefix = os.path.join(output_dir, "tokenizer")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines(),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        hard_vocab_limit=False,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    return [prefix + ".model", prefix + ".vocab"]


def train_huggingface(texts: Iterator[str], output_dir: str, vocab_size: int) -> list[str]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = _train_byte_level_bpe(texts, vocab_size, [EOD_TOKEN, "<pad>"])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOD_TOKEN, eos_token=EOD_TOKEN, pad_token="<pad>"
    )
    return list(wrapped.save_pretrained(output_dir))


# Qwen2-Instruct's chat template, as its tokenizer_config.json has it: a default system turn, no
# {% generation %} marks (preprocess-data --sft finds the assistant's tokens by rendering prefixes).
CHATML_TEMPLATE = (
    "{%- for message in messages %}{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_chatml(texts: Iterator[str], output_dir: str, vocab_size: int,
                 chat_template: str | None = CHATML_TEMPLATE) -> list[str]:
    """A chat model's tokenizer: byte-level BPE with ChatML's special tokens (``<|im_end|>`` ends a turn and is
    eos, as in Qwen2-Instruct) and ``chat_template`` (None: no template).

    Example::

        train_chatml(iter_jsonl_texts(["corpus.jsonl"]), "hf/chat", 1000)   # AutoTokenizer.from_pretrained("hf/chat")
    """
    from transformers import PreTrainedTokenizerFast

    specials = [EOD_TOKEN, "<|im_start|>", "<|im_end|>"]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=_train_byte_level_bpe(texts, vocab_size, specials), eos_token="<|im_end|>",
        pad_token=EOD_TOKEN, additional_special_tokens=specials[1:])
    wrapped.chat_template = chat_template
    return list(wrapped.save_pretrained(output_dir))


TRAINERS: dict[str, Callable[..., list[str]]] = {
    "gpt2-bpe": train_gpt2_bpe,
    "wordpiece": train_wordpiece,
    "sentencepiece": train_sentencepiece,
    "huggingface": train_huggingface,
    "chatml": train_chatml,
}


def train_tokenizer(
    kind: str, input: str, output_dir: str, vocab_size: int, json_key: str = "text", **options
) -> list[str]:
    """Train a `kind` tokenizer on the `json_key` texts of `input` (a JSONL path or glob).

        train_tokenizer("wordpiece", "stdlib.jsonl", "tok/", vocab_size=4000, lower_case=False)

    Returns the files written.
    """
    if kind not in TRAINERS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {', '.join(TRAINERS)}")
    os.makedirs(output_dir, exist_ok=True)
    return TRAINERS[kind](_JsonlTexts(expand_inputs(input), json_key), output_dir, vocab_size, **options)


class _JsonlTexts:
    """The ``json_key`` texts of the JSONL ``paths``, read afresh by each ``iter()``: the WordPiece trainer reads its
    texts twice, and a corpus need not fit in memory."""

    def __init__(self, paths: list[str], json_key: str):
        self.paths, self.json_key = paths, json_key

    def __iter__(self) -> Iterator[str]:
        return iter_jsonl_texts(self.paths, self.json_key)


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description="Train a tokenizer from JSONL with tokenizers/sentencepiece.")
    parser.add_argument("--kind", required=True, choices=sorted(TRAINERS))
    parser.add_argument("--input", required=True, help="a JSONL file or glob (.gz allowed)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--cased", action="store_true", help="wordpiece: keep case (for BertWordPieceCase)")
    args = parser.parse_args(argv)
    options = {"lower_case": not args.cased} if args.kind == "wordpiece" else {}
    files = train_tokenizer(args.kind, args.input, args.output_dir, args.vocab_size, args.json_key, **options)
    print("wrote " + ", ".join(files))
    return 0
