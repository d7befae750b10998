"""``--data-path`` checked without megatron-core: the launcher refuses a wrong one before torchrun starts, and does
not pay megatron-core's import (~3 s here) for it.

Example::

    check_data_path(["0.3", "data/a_text_document", "0.7", "data/b_text_document"])
    # ["data/a_text_document", "data/b_text_document"], once both have their .bin and .idx

The ranks build the blend with megatron-core's own parser (``datasets.parse_data_path``), after these checks.
"""

import os
from typing import Sequence

from megatron_patch.errors import UserError


class EmptyDataError(UserError, ValueError):
    """--data-path names data that gives no training samples. A ValueError as well: the launcher's argument check
    (training/arguments.py) reports those as one line before torchrun starts."""


def data_path_words(data_path: Sequence[str]) -> list[str]:
    """The words of ``--data-path`` values; one quoted string (``"0.3 a 0.7 b"``) works too."""
    words = [word for value in data_path for word in value.split()]
    if not words:
        raise ValueError("--data-path is empty; give prefixes (optionally weighted) or use --mock-data")
    return words


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_data_path(data_path: Sequence[str]) -> list[str]:
    """The dataset prefixes ``--data-path`` names, each checked to have its files and tokens; a ValueError naming the
    prefix and the fix otherwise.

    The words are told apart as megatron-core's ``get_blend_from_list`` (datasets/utils.py:49) tells them: an even
    number of words whose every other one, from the first, is a number are weights and prefixes; otherwise all are
    prefixes (weighted by their sizes). A number among those is a broken alternation, which megatron-core would take
    for a dataset's name.
    """
    words = data_path_words(data_path)
    weighted = len(words) % 2 == 0 and all(map(_is_number, words[0::2]))
    prefixes = words[1::2] if weighted else words
    if any(map(_is_number, prefixes)):
        raise ValueError(f"--data-path {' '.join(words)}: weights and prefixes must alternate ('0.3 a 0.7 b')")
    for prefix in prefixes:
        missing = [prefix + s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
        if missing:
            raise ValueError(
                f"--data-path {prefix}: {' and '.join(missing)} not found; give the prefix without "
                "the suffix, e.g. data/corpus_text_document"
            )
        # megatron-core memory-maps the .bin (indexed_dataset.py:402), which numpy refuses for an empty file:
        # "cannot mmap an empty file", deep in the dataset build.
        if os.path.getsize(prefix + ".bin") == 0:
            raise EmptyDataError(
                f"--data-path {prefix}: {prefix}.bin holds no tokens (its input had no documents, or only empty "
                "ones); preprocess a JSONL with text into it (megatron-patch preprocess-data), or leave it out"
            )
    return prefixes
