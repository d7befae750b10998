"""megatron-core GPT and BERT datasets over preprocessed `.bin/.idx` files (or mock data).

    train, valid, test = build_gpt_datasets(
        ["0.3", "data/a_text_document", "0.7", "data/b_text_document"], split="969,30,1",
        seq_length=1024, tokenizer=tok, train_valid_test_num_samples=[10000, 100, 10])

The datasets, blending and index caches are megatron-core's own (`GPTDataset`,
`BERTMaskedWordPieceDataset`, `BlendedMegatronDatasetBuilder`), with the prebuilt C++ helpers
from the wheel; `compile_helpers()` is never called (it needs a Makefile the wheel lacks, and
then exits the process).
"""

import contextlib
from typing import Callable, Iterator, Sequence

import numpy
import torch
from megatron.core.datasets.bert_dataset import (
    BERTMaskedWordPieceDataset,
    BERTMaskedWordPieceDatasetConfig,
)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_patch.data.data_path import DataError, EmptyDataError, check_data_path, check_token_ids, data_path_words

# megatron-core's BERT sample index (helpers.cpp, LONG_SENTENCE_LEN) skips a document of several sentences when one
# of them has more tokens than this.
_LONG_SENTENCE_LEN = 512


def parse_data_path(data_path: Sequence[str], vocab_size: int | None = None
                    ) -> tuple[list[str], list[float] | None]:
    """`--data-path` values -> (prefixes, weights or None), checking that the files exist and megatron-core can read
    them (``check_data_path``) and, with the tokenizer's ``vocab_size``, that it has every token id in them.

        parse_data_path(["0.3", "a", "0.7", "b"])   # (["a", "b"], [0.3, 0.7])
        parse_data_path(["a", "b"])                 # (["a", "b"], None): weighted by size
        parse_data_path(["0.3 a 0.7 b"])            # one quoted string works too
    """
    prefixes = check_data_path(data_path)
    if vocab_size is not None:
        check_token_ids(prefixes, vocab_size)
    return get_blend_from_list(data_path_words(data_path))


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """A one-process gloo group for the duration of a build when none exists.

    megatron-core 0.16.1 calls `torch.distributed.get_rank()` unguarded while building indices
    (`MaskedWordPieceDataset._build_sample_index`, `BlendedDataset._build_indices` when caching), so a
    single process without `init_process_group` would fail there.
    """
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _yields_samples(cls, config, low_level, first: int, last: int, chunk: int = 1 << 20) -> bool:
    """Whether elements ``[first, last)`` of a prefix (GPT: sequences, BERT: documents) make at least one sample;
    read ``chunk`` elements at a time, so real data answers from its first chunk."""
    for start in range(first, last, chunk):
        end = min(start + chunk, last)
        if cls is GPTDataset:
            if low_level.sequence_lengths[start:end].any():
                return True
            continue
        # build_mapping (helpers.cpp) samples a document with at least the minimum number of sentences (2 with the
        # binary head: BERTMaskedWordPieceDataset.__init__) and, when it has several, none longer than
        # LONG_SENTENCE_LEN.
        bounds = low_level.document_indices[start:end + 1]
        sentences = numpy.diff(bounds)
        long = low_level.sequence_lengths[bounds[0]:bounds[-1]] > _LONG_SENTENCE_LEN
        long_before = numpy.concatenate([[0], numpy.cumsum(long)])
        has_long = long_before[bounds[1:] - bounds[0]] > long_before[bounds[:-1] - bounds[0]]
        if ((sentences >= (2 if config.classification_head else 1)) & ((sentences == 1) | ~has_long)).any():
            return True
    return False


def _what_samples_need(cls, config) -> str:
    if cls is GPTDataset:
        return "tokens"
    if config.classification_head:
        return ("documents of two or more sentences (preprocess with --split-sentences, or train with "
                "--bert-no-binary-head)")
    return "documents with text"


def _check_splits(cls, config, num_samples: Sequence[int | None]) -> None:
    """Refuse a split that would get no data, or no sample from its data, but is asked for samples: megatron-core
    0.16.1 loops forever on it (`gpt_dataset.py` `_get_num_epochs` adds 0-token epochs; BERT's `build_mapping`
    runs 2**31 epochs of its documents, minutes for a few documents)."""
    for prefix in config.blend[0]:
        low_level = cls.build_low_level_dataset(prefix, config)
        # The builder's own count and rounding (`_build_megatron_dataset_splits`).
        count = cls.numel_low_level_dataset(low_level)
        for name, bounds, samples in zip(("train", "valid", "test"), config.split_matrix, num_samples):
            if bounds is None or not samples:
                continue
            first, last = int(round(bounds[0] * count)), int(round(bounds[1] * count))
            if last <= first:  # a user's mistake, said without a traceback (the launcher says it first)
                raise DataError(
                    f"--split {config.split} leaves the {name} split of {prefix} empty ({count} "
                    f"{'sequences' if cls is GPTDataset else 'documents'} in all) but {samples} {name} "
                    "samples are asked for; give that split a larger share, or ask for 0 samples"
                )
            if not _yields_samples(cls, config, low_level, first, last):
                raise EmptyDataError(f"--data-path {prefix}: the {name} split yields no samples but {samples} are "
                                     f"asked for; it needs {_what_samples_need(cls, config)}")


def _build(cls, config, num_samples: Sequence[int | None], is_built_on_rank: Callable[[], bool]):
    if not config.mock:
        _check_splits(cls, config, num_samples)
    with _process_group():
        return tuple(BlendedMegatronDatasetBuilder(cls, list(num_samples), is_built_on_rank, config).build())


def build_gpt_datasets(
    data_path: Sequence[str] | None,
    split: str,
    seq_length: int,
    tokenizer,
    train_valid_test_num_samples: Sequence[int | None],
    seed: int = 1234,
    mock: bool = False,
    data_cache_path: str | None = None,
    mmap_bin_files: bool = True,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> tuple:
    """(train, valid, test) GPT datasets; a split with no share in `split` is None.

    Each sample is megatron-core's dict: `tokens`, `labels` (tokens shifted by one), `loss_mask`,
    `position_ids` and, with `create_attention_mask`, a causal `attention_mask` (True = masked).
    `mock=True` gives megatron-core's `MockGPTDataset` and needs no `data_path`. In a distributed
    job pass `is_built_on_rank` (e.g. TP rank 0) as Megatron-LM does.
    """
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=None if mock else parse_data_path(data_path or [], tokenizer.vocab_size),
        split=split,
        path_to_cache=data_cache_path,
        mmap_bin_files=mmap_bin_files,  # False: Megatron-LM's --no-mmap-bin-files (file reads)
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    return _build(MockGPTDataset if mock else GPTDataset, config, train_valid_test_num_samples, is_built_on_rank)


def build_bert_datasets(
    data_path: Sequence[str],
    split: str,
    seq_length: int,
    tokenizer,
    train_valid_test_num_samples: Sequence[int | None],
    seed: int = 1234,
    binary_head: bool = True,
    masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1,
    data_cache_path: str | None = None,
    mmap_bin_files: bool = True,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> tuple:
    """(train, valid, test) BERT masked-LM datasets over sentence-level data.

    Samples are megatron-core's dict: `text` (`[CLS] A [SEP] B [SEP]` then pad), `types`,
    `labels` (-1 where nothing is predicted), `is_random` (the next-sentence label when
    `binary_head`), `padding_mask` and `loss_mask`. Masking follows Megatron-LM's
    `pretrain_bert.py`: 15% of whole words, n-grams up to 3.
    """
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=parse_data_path(data_path, tokenizer.vocab_size),
        split=split,
        path_to_cache=data_cache_path,
        mmap_bin_files=mmap_bin_files,  # False: Megatron-LM's --no-mmap-bin-files (file reads)
        tokenizer=tokenizer,
        masking_probability=masked_lm_prob,
        short_sequence_probability=short_seq_prob,
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=binary_head,
    )
    return _build(BERTMaskedWordPieceDataset, config, train_valid_test_num_samples, is_built_on_rank)
