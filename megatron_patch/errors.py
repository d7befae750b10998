"""Errors a user can fix, reported by the command-line tools as one line; the traceback only when debugging.

Example::

    from megatron_patch.errors import UserError, one_line_errors

    @one_line_errors("megatron-patch convert")
    def main(argv=None) -> int:
        raise UserError("ckpt/args.json: not valid JSON (line 3); re-run the conversion that wrote it")

prints ``megatron-patch convert: error: ckpt/args.json: not valid JSON ...`` and returns 1. With
``MEGATRON_PATCH_DEBUG=1`` in the environment (``megatron-patch --debug ...`` sets it, and torchrun's ranks inherit
it) the traceback is printed first.

Below it, ``unwind_on_sigterm`` (a SIGTERM that runs the cleanup) and two helpers for such messages:
``first_problems`` (a long list cut to one line) and ``read_json`` (a damaged JSON file as a UserError naming it).
Every command's parser is a ``FlagParser``, which names the flag meant after a misspelled one.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import functools
import json
import os
import signal
import sys
import traceback
from typing import Callable

DEBUG_ENV = "MEGATRON_PATCH_DEBUG"


class UserError(Exception):
    """Bad input or a bad environment: the message names the file, line or flag, and the fix."""


def did_you_mean(words: list[str], options: list[str]) -> str:
    """`` (did you mean --x?)`` for the unknown flags among ``words`` that are close to one of ``options``, or "".

    Example::

        >>> did_you_mean(["--micro-batch-szie", "4"], ["--micro-batch-size", "--global-batch-size"])
        ' (--micro-batch-szie: did you mean --micro-batch-size?)'
    """
    meant = []
    for word in words:
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, options, n=1) if flag.startswith("--") and flag not in options else []
        meant += [f"{flag}: did you mean {close[0]}?"] if close else []
    return f" ({'; '.join(meant)})" if meant else ""


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The ``--flags`` of ``parser`` and of its subcommands' parsers."""
    found = [option for option in parser._option_string_actions if option.startswith("--")]
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for sub in getattr(action, "choices", {}).values():
            found += option_strings(sub)
    return found


class FlagParser(argparse.ArgumentParser):
    """argparse's parser whose "unrecognized arguments" error names the flag meant (difflib over its own and its
    subcommands' flags).

    Example::

        FlagParser(prog="megatron-patch preprocess-data").parse_args(["--ouput-prefix", "data/c"])
        # megatron-patch preprocess-data: error: unrecognized arguments: --ouput-prefix data/c (--ouput-prefix: did
        # you mean --output-prefix?)
    """

    _given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        # Kept for error(): a misspelled required flag is reported as a missing one, before the unknown ones.
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        super().error(message + did_you_mean(self._given, option_strings(self)))


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint directory with a missing, truncated or damaged file (a save that died half-way, a damaged disk
    or copy), or a file whose pickle would run code (``unpickle``)."""


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def describe(error: BaseException) -> str:
    """The one line for ``error``: an ``OSError`` names its file and, for a full disk, what to do."""
    if isinstance(error, OSError) and not isinstance(error, UserError):
        where = f"{error.filename}: " if error.filename else ""
        if error.errno == errno.ENOSPC:
            return f"{where}no space left on the device; free some space or write to another disk, then re-run"
        return f"{where}{error.strerror or error}"
    return str(error)


def one_line_errors(prog: str, expected: tuple[type[BaseException], ...] = (UserError, OSError)) -> Callable:
    """Decorate a ``main(argv) -> int``: ``expected`` errors become ``PROG: error: ...`` on stderr and status 1."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            global _stopped_by
            _stopped_by = None
            try:
                return main(*args, **kwargs)
            except BaseException as error:
                # A library that caught the SystemExit unwind_on_sigterm raised, and raised its own error instead
                # (torch.distributed.checkpoint's collectives wrap every exception in a CheckpointException): the
                # command was stopped, not broken, and its cleanup has run.
                stopped = _stopped_by is not None and not isinstance(error, SystemExit)
                interrupted = isinstance(error, KeyboardInterrupt)  # Ctrl-C in a terminal: a stop, not a bug
                if not stopped and not interrupted and not isinstance(error, expected):
                    raise
                if debugging():
                    traceback.print_exc()
                if stopped:
                    return 128 + _stopped_by
                if interrupted:
                    print(f"\n{prog}: stopped by Ctrl-C (SIGINT)", file=sys.stderr, flush=True)
                    return 128 + signal.SIGINT
                print(f"{prog}: error: {describe(error)}", file=sys.stderr, flush=True)
                return 1

        return run

    return wrap


def first_problems(problems: list[str], shown: int = 4) -> str:
    """Problems for a one-line message: the first ``shown``, then how many more.

    Example::

        >>> first_problems(["missing tensor a", "missing tensor b", "missing tensor c"], shown=2)
        'missing tensor a; missing tensor b; and 1 more'
    """
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def read_json(path: str, fix: str):
    """The JSON in ``path``; a damaged file is a UserError naming it, where the parser stopped, and ``fix``.

    Example::

        read_json("llama-hf/config.json", "restore the model's config.json")
    """
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: not valid JSON ({error.msg}: line {error.lineno} column {error.colno}); "
                            f"{fix}") from None


def unwind_on_sigterm() -> None:
    """From now on a SIGTERM (a scheduler's time limit, ``kill``) raises ``SystemExit(143)`` in the main thread.

    Example::

        unwind_on_sigterm()
        with open("out.tmp", "w") as f:    # a SIGTERM here still runs the cleanup below
            ...

    The default action ends the process at once, so no ``finally`` or ``except`` block runs and a command's
    temporary files stay behind; raised, the signal unwinds like an error and they are removed.
    """
    signal.signal(signal.SIGTERM, _raise_exit)


# The signal _raise_exit turned into SystemExit during the current one_line_errors command, if any.
_stopped_by: int | None = None


def _raise_exit(signum, frame) -> None:
    global _stopped_by
    _stopped_by = signum
    raise SystemExit(128 + signum)
