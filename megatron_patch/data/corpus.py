"""A corpus every machine has: the Python standard library's own source files, as JSONL.

    python toolkits/make_corpus.py --output stdlib.jsonl --max-mb 30

Each line is `{"text": <source>, "path": <path relative to the stdlib>}`; files are taken in
sorted order, so the same Python version always gives the same corpus. Tests, benchmarks and
the quick start build on it instead of downloading a data set.
"""

import json
import os
import sysconfig
from typing import Iterator

from megatron_patch.errors import FlagParser


def iter_stdlib_sources(root: str | None = None) -> Iterator[tuple[str, str]]:
    """`(relative path, source text)` of each UTF-8 `.py` file under the stdlib, sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    for directory, subdirs, files in os.walk(root):
        # Third-party code is not part of the corpus and differs from machine to machine.
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(files):
            # _sysconfigdata_*.py is this machine's build configuration (a large dict of compiler flags), not code.
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, root), f.read()
            except (UnicodeDecodeError, OSError):
                continue


def _chunks(text: str, max_chars: int | None) -> Iterator[str]:
    """`text` cut at line ends into pieces of at most `max_chars` (a longer line stays whole)."""
    if max_chars is None:
        yield text
        return
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        if piece and size + len(line) > max_chars:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece:
        yield "".join(piece)


def write_stdlib_corpus(
    output: str,
    max_docs: int | None = None,
    max_bytes: int | None = None,
    max_doc_chars: int | None = None,
    root: str | None = None,
) -> int:
    """Write the corpus to `output` and return the number of documents written.

        write_stdlib_corpus("small.jsonl", max_docs=200, max_doc_chars=2000)

    Stops at `max_docs` documents or once `max_bytes` of JSONL are written; `max_doc_chars`
    cuts files into documents of at most that many characters. Blank pieces are left out.
    """
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    staging = output + ".tmp"  # renamed when complete: an interrupted run leaves no half corpus under `output`
    with open(staging, "w", encoding="utf-8") as f:
        written = _write_documents(f, iter_stdlib_sources(root), max_docs, max_bytes, max_doc_chars)
    os.replace(staging, output)
    return written


def _write_documents(f, sources, max_docs: int | None, max_bytes: int | None, max_doc_chars: int | None) -> int:
    written = size = 0
    for relpath, source in sources:
        for text in _chunks(source, max_doc_chars):
            if not text.strip():
                continue
            if (max_docs is not None and written >= max_docs) or (max_bytes is not None and size >= max_bytes):
                return written
            line = json.dumps({"text": text, "path": relpath}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode("utf-8"))
            written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description="Write the Python standard library's sources as JSONL.")
    parser.add_argument("--output", required=True, help="the JSONL file to write")
    parser.add_argument("--max-docs", type=int, help="stop after this many documents")
    parser.add_argument("--max-mb", type=float, help="stop after about this many MB of JSONL")
    parser.add_argument("--max-doc-chars", type=int, help="cut files into documents of at most this many characters")
    args = parser.parse_args(argv)
    count = write_stdlib_corpus(
        args.output,
        max_docs=args.max_docs,
        max_bytes=None if args.max_mb is None else int(args.max_mb * 1e6),
        max_doc_chars=args.max_doc_chars,
    )
    print(f"wrote {count} documents to {args.output}")
    return 0
