"""``--data-path`` checked without megatron-core: the launcher refuses a missing prefix or an .idx megatron-core
cannot read before torchrun starts, and does not pay megatron-core's import (~3 s here) for it.

Example::

    check_data_path(["0.3", "data/a_text_document", "0.7", "data/b_text_document"])
    # ["data/a_text_document", "data/b_text_document"], once both have their .bin and .idx

The ranks build the blend with megatron-core's own parser (``datasets.parse_data_path``), after these checks.
"""

import json
import os
import re
import struct
from typing import Sequence

import numpy

from megatron_patch.errors import UserError

# megatron-core's .idx layout (datasets/indexed_dataset.py, _IndexWriter.write and _IndexReader.__init__, 0.16.1):
# the magic, version 1, a dtype code, the sequence and document counts, then int32 lengths and int64 pointers per
# sequence, int64 document indices (and one int8 mode per sequence in multimodal data).
_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
_TOKEN_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 6: numpy.float64,
                 7: numpy.float32, 8: numpy.uint16}
_REBUILD = "preprocess its JSONL again (megatron-patch preprocess-data) or give the right prefix"


class DataError(UserError, ValueError):
    """A --data-path file missing or one megatron-core cannot read, or tokens the run's tokenizer does not have. A
    ValueError as well: the launcher's argument check (training/arguments.py) reports those as one line before
    torchrun starts. Every rank finds the same, so a rank's report is printed once (``same_on_every_rank``)."""

    same_on_every_rank = True


class EmptyDataError(DataError):
    """--data-path names data that gives no training samples."""


def read_index(prefix: str) -> tuple[numpy.dtype, int, int]:
    """``(token dtype, sequences, documents)`` of ``prefix.idx``, its header and size checked against what
    megatron-core reads, and ``prefix.bin``'s size against the last sequence it points to; a DataError naming the
    file otherwise (megatron-core's own: 'buffer is smaller than requested size', or a bare AssertionError).

    Example::

        read_index("data/corpus_text_document")     # (dtype('uint16'), 1200, 1200)
    """
    path = prefix + ".idx"
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or not head.startswith(_INDEX_HEADER):
            raise DataError(f"--data-path {prefix}: {path} is not a megatron-core index (its header is not "
                            f"MMIDIDX); {_REBUILD}")
        _, version, code, sequences, documents = _HEADER.unpack(head)
        if version != 1 or code not in _TOKEN_DTYPES:
            raise DataError(f"--data-path {prefix}: {path} has index version {version}, token type code {code}; "
                            f"megatron-core reads version 1 with codes 1-8: {_REBUILD}")
        arrays = 12 * sequences + 8 * documents
        size = os.path.getsize(path)
        # multimodal indices carry one more byte per sequence
        if size not in (_HEADER.size + arrays, _HEADER.size + arrays + sequences):
            raise DataError(f"--data-path {prefix}: {path} is {size} bytes, its header promises "
                            f"{_HEADER.size + arrays} ({sequences} sequences, {documents} documents): it is "
                            f"truncated or damaged; {_REBUILD}")
        dtype = numpy.dtype(_TOKEN_DTYPES[code])
        if sequences:
            f.seek(_HEADER.size + 4 * (sequences - 1))
            (length,) = struct.unpack("<i", f.read(4))
            f.seek(_HEADER.size + 4 * sequences + 8 * (sequences - 1))
            (pointer,) = struct.unpack("<q", f.read(8))
            needed, held = pointer + length * dtype.itemsize, os.path.getsize(prefix + ".bin")
            if held < needed:
                raise DataError(f"--data-path {prefix}: {prefix}.bin is {held} bytes, {path} points to {needed}: "
                                f"the .bin is truncated or from another run; {_REBUILD}")
    return dtype, sequences, documents


def check_token_ids(prefixes: Sequence[str], vocab_size: int) -> None:
    """Refuse data with a token id the tokenizer's ``vocab_size`` does not reach (the embedding lookup failed deep
    in the first step: 'IndexError: index out of range in self'), naming the file; ``largest_token_id`` of each.

    Example::

        check_token_ids(["data/corpus_text_document"], tokenizer.vocab_size)
    """
    for prefix in prefixes:
        largest = largest_token_id(prefix)
        if largest >= vocab_size:
            raise DataError(f"--data-path {prefix}: {prefix}.bin holds token id {largest}, beyond this tokenizer's "
                            f"{vocab_size} tokens: the data was tokenized with another tokenizer; give that "
                            "tokenizer's flags, or preprocess the data again with this one")


# preprocess-data records the largest token id of PREFIX.bin in PREFIX.tokens.json, with the .bin's size and
# modification time: a .bin written or changed since (Megatron-LM's preprocess_data.py under the same prefix) does
# not match them, and is read instead.
_RECORD = ".tokens.json"
_RECORD_FORMAT = {"format": "megatron_patch token ids", "version": 1}
# The largest token ids the launcher read from .bin files without a record, by prefix, handed to its ranks in the
# environment torchrun passes on, so that a start reads such data once, not once more per node.
_READ_ENV = "MEGATRON_PATCH_LARGEST_TOKEN_IDS"


def record_largest_token_id(prefix: str) -> None:
    """Write ``PREFIX.tokens.json``: the largest token id in ``PREFIX.bin`` (-1 for none) and the .bin's size and
    modification time, which ``largest_token_id`` checks before it trusts the record.

    Example::

        record_largest_token_id("data/corpus_text_document")
        # data/corpus_text_document.tokens.json: {"format": ..., "version": 1, "largest_token_id": 49151, "bin": [...]}
    """
    with open(prefix + _RECORD, "w") as f:
        json.dump({**_RECORD_FORMAT, "largest_token_id": _read_largest(prefix), "bin": _bin_identity(prefix)}, f)


def largest_token_id(prefix: str) -> int:
    """The largest token id in ``PREFIX.bin`` (-1 for none): from its ``PREFIX.tokens.json`` when that describes
    this .bin, from the launcher when it read this .bin already, else read in full (data written by Megatron-LM).

    Example::

        largest_token_id("data/corpus_text_document")     # 49151
    """
    identity = _bin_identity(prefix)
    try:
        with open(prefix + _RECORD) as f:
            record = json.load(f)
        if {key: record.get(key) for key in _RECORD_FORMAT} == _RECORD_FORMAT and record.get("bin") == identity:
            return int(record["largest_token_id"])
    except (OSError, ValueError, TypeError, KeyError):  # none, or one cut short: the .bin tells
        pass
    read = json.loads(os.environ.get(_READ_ENV, "{}"))
    key = os.path.abspath(prefix)
    if key in read and read[key][1:] == identity:
        return read[key][0]
    largest = _read_largest(prefix)
    os.environ[_READ_ENV] = json.dumps({**read, key: [largest, *identity]})
    return largest


def _bin_identity(prefix: str) -> list[int]:
    stat = os.stat(prefix + ".bin")
    return [stat.st_size, stat.st_mtime_ns]


def _read_largest(prefix: str) -> int:
    """One pass over ``PREFIX.bin``."""
    dtype, _, _ = read_index(prefix)
    if not os.path.getsize(prefix + ".bin"):
        return -1
    return int(numpy.memmap(prefix + ".bin", dtype=dtype, mode="r").max())


def split_ranges(count: int, split: str) -> list[tuple[int, int] | None]:
    """The (begin, end) documents of the train, valid and test splits of ``--split`` over ``count`` documents, None
    for a zero share, as megatron-core splits them (``parse_and_normalize_split``,
    ``convert_split_vector_to_split_matrix`` and ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``,
    0.16.1 and 0.19) but without importing it: the launcher checks the splits before any rank starts, and
    megatron-core costs seconds to import (tests/test_sft.py compares the two).

    Example::

        >>> split_ranges(100, "98,2,0")
        [(0, 98), (98, 100), None]
    """
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if len(weights) > 3 or not sum(weights):
        raise ValueError(f"--split {split}: give three weights such as 969,30,1 (train, valid, test)")
    weights = [w / sum(weights) for w in weights + [0.0] * (3 - len(weights))]
    ranges, start = [], 0.0
    for weight in weights:
        end = start + weight
        ranges.append((int(round(start * count)), int(round(end * count))) if end > start else None)
        start = end
    return ranges


def data_path_words(data_path: Sequence[str]) -> list[str]:
    """The words of ``--data-path`` values; one quoted string (``"0.3 a 0.7 b"``) works too."""
    words = [word for value in data_path for word in value.split()]
    if not words:
        raise ValueError("--data-path is empty; give prefixes (optionally weighted) or use --mock-data")
    return words


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_data_path(data_path: Sequence[str]) -> list[str]:
    """The dataset prefixes ``--data-path`` names, each checked to have its files and tokens; a ValueError naming the
    prefix and the fix otherwise.

    The words are told apart as megatron-core's ``get_blend_from_list`` (datasets/utils.py) tells them: an even
    number of words whose every other one, from the first, is a number are weights and prefixes; otherwise all are
    prefixes (weighted by their sizes). A number among those is a broken alternation, which megatron-core would take
    for a dataset's name.
    """
    words = data_path_words(data_path)
    weighted = len(words) % 2 == 0 and all(map(is_number, words[0::2]))
    prefixes = words[1::2] if weighted else words
    if any(map(is_number, prefixes)):
        raise ValueError(f"--data-path {' '.join(words)}: weights and prefixes must alternate ('0.3 a 0.7 b')")
    for prefix in prefixes:
        missing = [prefix + s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
        if missing:
            raise DataError(
                f"--data-path {prefix}: {' and '.join(missing)} not found; give the prefix without "
                "the suffix, e.g. data/corpus_text_document"
            )
        # megatron-core memory-maps the .bin (indexed_dataset.py's _MMapBinReader), which numpy refuses for an empty
        # file: "cannot mmap an empty file", deep in the dataset build.
        if os.path.getsize(prefix + ".bin") == 0:
            raise EmptyDataError(
                f"--data-path {prefix}: {prefix}.bin holds no tokens (its input had no documents, or only empty "
                "ones); preprocess a JSONL with text into it (megatron-patch preprocess-data), or leave it out"
            )
        read_index(prefix)
    return prefixes
