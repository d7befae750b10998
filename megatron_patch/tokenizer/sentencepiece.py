"""SentencePiece tokenizers (`--tokenizer-model tokenizer.model`), Megatron-LM's three flavours.

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model="tokenizer.model")

- `SentencePieceTokenizer`: adds `<CLS> <SEP> <EOD> <MASK>` (and `<PAD>` when the model has no pad
  piece) after the model's pieces, and encodes those tokens, and the model's bos/eos/pad pieces,
  where they appear literally in the text; eod is `<EOD>`.
- `GPTSentencePieceTokenizer`: the model alone; eod is the model's eos.
- `Llama2Tokenizer`: the model with bos prepended to every text; eod is eos.
"""

import numpy

from megatron_patch.tokenizer.base import Tokenizer
from megatron_patch.tokenizer.registry import (
    TokenizerFileError,
    register_tokenizer,
    require_file,
)


def load_sentencepiece(path: str):
    """A `SentencePieceProcessor`, with an error naming the file when it is not a model."""
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as error:
        raise TokenizerFileError(f"{path}: not a SentencePiece .model file ({error})") from None


class _SentencePieceBase(Tokenizer):
    """The model's pieces as vocab, its bos/eos/pad as special tokens and eos as eod."""

    def __init__(self, tokenizer_model: str | None = None, **options):
        path = require_file(
            tokenizer_model, "--tokenizer-model", type(self).__name__, "a SentencePiece .model"
        )
        super().__init__(path, **options)
        self._sp = load_sentencepiece(path)
        self._vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        eos = self._piece_id(self._sp.eos_id())
        self._special_ids = {
            "bos": self._piece_id(self._sp.bos_id()), "eos": eos, "eod": eos, "pad": self._piece_id(self._sp.pad_id()),
        }

    def _piece_id(self, special_id: int) -> int | None:
        """The model's bos/eos/pad id, or None where the model has none (SentencePiece gives -1)."""
        return special_id if 0 <= special_id < len(self._sp) else None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=1)

    def detokenize(self, ids) -> str:
        return self._sp.decode(numpy.asarray(ids).tolist())


@register_tokenizer("GPTSentencePieceTokenizer")
class GPTSentencePieceTokenizer(_SentencePieceBase):
    """Megatron-LM's `_GPTSentencePieceTokenizer`: the model alone."""


@register_tokenizer("Llama2Tokenizer")
class Llama2Tokenizer(_SentencePieceBase):
    """Megatron-LM's `_Llama2Tokenizer`: bos before every text."""

    def __init__(self, tokenizer_model: str | None = None, **options):
        super().__init__(tokenizer_model, **options)
        if self.bos is None:
            # Megatron-LM would prepend SentencePiece's -1, which the .bin stores as its dtype's largest id.
            raise TokenizerFileError(
                f"{tokenizer_model}: the SentencePiece model has no bos piece, which Llama2Tokenizer puts before every "
                "text; use --tokenizer-type GPTSentencePieceTokenizer (the model alone), or a model trained with one "
                "(spm_train --bos_id)")

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [[self.bos, *ids] for ids in super().tokenize_batch(texts)]


@register_tokenizer("SentencePieceTokenizer")
class SentencePieceTokenizer(_SentencePieceBase):
    """Megatron-LM's `_SentencePieceTokenizer` (the one BERT and T5 recipes use)."""

    def __init__(self, tokenizer_model: str | None = None, vocab_extra_ids: int = 0):
        super().__init__(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
        # Megatron's special-token property -> its token: pad, bos and eos are the model's pieces where it has
        # them. Order matters twice: new tokens get ids in this order, and when two special tokens start at the
        # same character the earlier one here wins (as in Megatron-LM).
        tokens = {"cls": "<CLS>", "sep": "<SEP>", "eod": "<EOD>", "mask": "<MASK>"}
        model_pieces = (("pad", self._sp.pad_id(), "<PAD>"), ("bos", self._sp.bos_id(), "<BOS>"),
                        ("eos", self._sp.eos_id(), "<EOS>"))
        for name, special_id, fallback in model_pieces:
            tokens[name] = self._sp.id_to_piece(special_id) if self._piece_id(special_id) is not None else fallback
        self._t5_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        self._special_tokens: dict[str, int] = {}
        for token in [*tokens.values(), *self._t5_tokens]:
            if token not in self._vocab:
                self._vocab[token] = len(self._vocab)
                self._inv_vocab[self._vocab[token]] = token
            self._special_tokens[token] = self._vocab[token]
        self._inv_special_tokens = {i: t for t, i in self._special_tokens.items()}
        self.additional_special_tokens_ids = [self._vocab[t] for t in self._t5_tokens]
        self._special_ids = {name: self._vocab[token] for name, token in tokens.items()}

    def _split_specials(self, text: str) -> list[str | int]:
        """`"a<SEP>b"` -> `["a", sep_id, "b"]`: plain segments (possibly empty) and special ids."""
        parts: list[str | int] = []
        start = 0
        while True:
            found, token = -1, None
            for name in self._special_tokens:
                at = text.find(name, start)
                if at != -1 and (found == -1 or at < found):
                    found, token = at, name
            if token is None:
                parts.append(text[start:])
                return parts
            parts.extend((text[start:found], self._special_tokens[token]))
            start = found + len(token)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        split = [self._split_specials(text) for text in texts]
        plain = super().tokenize_batch([p for parts in split for p in parts if isinstance(p, str)])
        encoded = iter(plain)
        return [
            [i for p in parts for i in (next(encoded) if isinstance(p, str) else (p,))]
            for parts in split
        ]

    def detokenize(self, ids) -> str:
        ids = numpy.asarray(ids).tolist()
        pieces, last = [], 0
        for position, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                pieces += [self._sp.decode(ids[last:position]), self._inv_special_tokens[token_id]]
                last = position + 1
        pieces.append(self._sp.decode(ids[last:]))
        return " ".join(p for p in pieces if p)
