"""JSONL input files: globs, `.gz`, and lenient reading for tools that need only the text.

    for text in iter_jsonl_texts(expand_inputs("corpus/*.jsonl.gz"), key="text"):
        ...
"""

import glob
import gzip
import json
import os
from typing import BinaryIO, Iterator


class InputError(ValueError):
    """Bad input data; the message names the file and line: `a.jsonl:17: no key 'text'`."""


def expand_inputs(pattern: str) -> list[str]:
    """The files `pattern` names (a path or a glob), sorted; an InputError if there are none."""
    paths = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        raise InputError(f"--input {pattern}: no such file" + ("" if paths else " (the glob matches nothing)"))
    return paths


def open_input(path: str) -> BinaryIO:
    """Open a plain or gzip-compressed input for reading bytes."""
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iter_jsonl_texts(paths: list[str], key: str = "text") -> Iterator[str]:
    """The string under `key` of each JSONL line; lines that are not such objects are skipped."""
    for path in paths:
        with open_input(path) as f:
            for line in f:
                try:
                    value = json.loads(line).get(key)
                except (ValueError, AttributeError):
                    continue
                if isinstance(value, str) and value:
                    yield value
