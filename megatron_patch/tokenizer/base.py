"""The base of our tokenizers: the interface megatron-core's datasets and Megatron-LM's scripts read, plus batch
encoders.

    class MyTokenizer(Tokenizer):      # registered with @register_tokenizer("MyTokenizer") (registry.py)
        def tokenize(self, text): ...

    ids, lengths = tok.tokenize_batch_flat(["first document", "second one"], numpy.uint16)

It stands on its own: the base it replaces, megatron-core's ``MegatronLegacyTokenizer``
(megatron/core/datasets/megatron_tokenizer.py), is gone from 0.17 on, and its successor
(``megatron.core.tokenizers.MegatronTokenizerBase``) wants a chat template and a config of every tokenizer. What
megatron-core's datasets read of a tokenizer is the same in 0.16.1 and 0.19.2: ``vocab_size``, ``inv_vocab``,
the special-token ids below, and ``unique_identifiers``, which they hash into their cache names
(``MegatronDataset.__init__``, ``default=lambda obj: obj.unique_identifiers``).
"""

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from itertools import chain

import numpy


def special_token_property(name: str) -> property:
    """The special-token id ``name`` (``cls``, ``eod``, ...) answered from the tokenizer's `_special_ids` table.

        eod = special_token_property("eod")   # tok.eod == tok._special_ids["eod"]

    A name the table lacks raises NotImplementedError (`GPT2BPETokenizer has no attribute 'cls'`), the error
    Megatron-LM's tokenizers give and callers probing for a token (`try: tok.mask`) rely on.
    """

    def special_id(self: "Tokenizer") -> int | None:
        if name in self._special_ids:
            return self._special_ids[name]
        raise NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    return property(special_id, doc=f"The {name.upper()} token id (None: the tokenizer's model has none).")


class Tokenizer(ABC):
    """Base of our tokenizers: the interface megatron-core's datasets read, plus a batch encoder.

        tok = GPT2BPETokenizer("gpt2-vocab.json", "gpt2-merges.txt")   # Tokenizer.__init__(*paths, **options)
        ids_per_text = tok.tokenize_batch(["first document", "second one"])

    The paths and options the tokenizer was built from are its `unique_identifiers`, which megatron-core's datasets
    hash into their cache names. Subclasses fill `_vocab` (token -> id), `_inv_vocab` and `_special_ids`,
    the one table behind the special-token properties below.
    """

    _vocab: dict[str, int]
    _inv_vocab: dict[int, str]
    _special_ids: dict[str, int | None] = {}
    """Megatron's special-token property name -> id, e.g. `{"eod": 50256, "eos": 50256}` for GPT-2. None: the
    tokenizer's model has no such token; a name missing: the property raises."""

    # The ids megatron-core's datasets, Megatron-LM's scripts and ours read (`tok.eod`, `tok.pad`, ...).
    cls = special_token_property("cls")
    sep = special_token_property("sep")
    pad = special_token_property("pad")
    eod = special_token_property("eod")
    bos = special_token_property("bos")
    eos = special_token_property("eos")
    mask = special_token_property("mask")

    def __init__(self, *tokenizer_paths: str, **tokenizer_options) -> None:
        # The keys and values megatron-core's MegatronLegacyTokenizer used (0.16.1), so that the datasets' cache
        # names stay what they were.
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The ids of ``text``."""

    @abstractmethod
    def detokenize(self, ids) -> str:
        """The text of ``ids``."""

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """`[tok.tokenize(t) for t in texts]`, computed by the fastest path the backend has."""
        return [self.tokenize(text) for text in texts]

    def tokenize_batch_flat(self, texts: list[str], dtype: type) -> tuple[numpy.ndarray, numpy.ndarray]:
        """`tokenize_batch(texts)` as the ids of all texts one after another in one `dtype` array, and each
        text's number of ids (int64): the form `.bin` files take, without a Python list per text where the
        backend has a faster path (GPT-2 BPE does).

            ids, lengths = tok.tokenize_batch_flat(["a b", "c"], numpy.int32)   # ids[:lengths[0]] are "a b"'s
        """
        per_text = self.tokenize_batch(texts)
        lengths = numpy.fromiter(map(len, per_text), dtype=numpy.int64, count=len(per_text))
        return numpy.fromiter(chain.from_iterable(per_text), dtype=dtype, count=int(lengths.sum())), lengths


class BackendTokenizer(Tokenizer):
    """A tokenizer whose encoding is one HF `tokenizers` pipeline, `self._backend`, adding no
    special tokens (GPT-2 BPE, BERT WordPiece)."""

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self._backend.decode(numpy.asarray(ids).tolist(), skip_special_tokens=False)


