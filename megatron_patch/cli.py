"""The ``megatron-patch`` command: one entry point, one subcommand per user step.

Example::

    megatron-patch quickstart
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, NoReturn

from megatron_patch.compat import PrintVersions
from megatron_patch.errors import DEBUG_ENV, FlagParser
from megatron_patch.startup import show_known_noise


def launch(module: str, nproc_per_node: int, module_args: list[str]) -> int:
    """Run ``python -m module`` on ``nproc_per_node`` processes of this host with torch's elastic launcher (in this
    process, as ``rapidformer`` does: SIGTERM and failures are handled alike)."""
    from megatron_patch.training.launcher import run_torchrun, torchrun_command  # here: the data tools need no torch

    command = torchrun_command(module, module_args, nproc_per_node, this_host_only=True)
    print("+ " + " ".join(command), flush=True)
    return run_torchrun(command)


def _quickstart(args: argparse.Namespace, rest: list[str]) -> int:
    from megatron_patch.quickstart import main as quickstart  # here: the other subcommands need none of it

    return quickstart(rest)


def _forward(module: str):
    """A subcommand that hands its arguments to ``module.main(argv)`` (the toolkits' own parsers)."""

    def run(args: argparse.Namespace, rest: list[str]) -> int:
        # argparse's default prog is sys.argv[0]'s base name, so the tools' usage lines name the subcommand.
        sys.argv[0] = f"megatron-patch {args.command}"
        return importlib.import_module(module).main(rest)

    return run


# name -> (module whose main() takes the arguments, help)
TOOLS = {
    "make-corpus": ("megatron_patch.data.corpus", "write the Python standard library's sources as a JSONL corpus"),
    "make-stand-ins": ("megatron_patch.data.stand_ins", "tiny random stand-ins for the README's inputs (a Qwen2 "
                       "chat model, a GLUE task, conversations, a SentencePiece tokenizer)"),
    "train-tokenizer": ("megatron_patch.data.train_tokenizer",
                        "train a GPT-2 BPE, WordPiece or SentencePiece tokenizer"),
    "preprocess-data": ("megatron_patch.data.preprocess", "tokenize JSONL into Megatron .bin/.idx files"),
    "convert": ("megatron_patch.convert.cli", "Hugging Face <-> Megatron checkpoints, verified"),
    "train": ("megatron_patch.training.launcher", "the rapidformer launcher: --task or --user-script on N processes"),
    "checkpoint": ("megatron_patch.training.reshard",
                   "reshard a checkpoint's distributed-optimizer state to resume at another TP/PP"),
}


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(prog="megatron-patch", description="Train GPT and BERT on megatron-core.")
    parser.add_argument("--version", action=PrintVersions, help="print the versions of this package, Python, torch, "
                        "megatron-core, Transformer Engine and apex, then exit")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback behind an error and the upstream warnings silenced by default "
                             "(startup.KNOWN_WARNINGS; sets MEGATRON_PATCH_DEBUG=1 for every process)")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in TOOLS.items():
        tool = commands.add_parser(name, help=help_text, add_help=False)
        tool.set_defaults(run=_forward(module))
    quickstart = commands.add_parser(
        "quickstart", add_help=False,
        help="corpus, tokenizer, data, a tiny GPT pretrained with TP=2 on 2 CPU processes, its Hugging Face "
             "export generating text (no download; --gpus N for GPUs)",
    )
    quickstart.set_defaults(run=_quickstart)
    args, rest = parser.parse_known_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the ranks torchrun starts inherit it
        show_known_noise()  # this process imported the package, and silenced them, before --debug was read
    return args.run(args, rest)


def exit_with(status: int) -> NoReturn:
    """End a command's process with ``status``.

    Example::

        exit_with(status)      # never returns

    A process that ran gloo collectives (a conversion's or a verification's own world, a torchrun rank of
    ``convert verify``) ends through ``distributed.exit_rank``: after gloo, a normal interpreter exit sometimes
    aborts with "terminate called without an active exception" (SIGABRT, status -6; docs/megatron-core-on-cpu.md,
    item 11), which turned a passed verification into a failed command; so does one whose own world is destroyed
    already (``distributed.one_rank_world``). torch is looked up in ``sys.modules``, so a command that never needed
    it (``--help``, the data tools) is not made to import it.
    """
    torch, distributed = sys.modules.get("torch"), sys.modules.get("megatron_patch.distributed")
    in_a_world = torch is not None and torch.distributed.is_initialized()
    if in_a_world or getattr(distributed, "ran_a_process_group", False):
        from megatron_patch.distributed import exit_rank

        exit_rank(status)
    sys.exit(status)


def run(command: Callable[[], int] | None = None) -> NoReturn:
    """Run ``command`` (by default the ``megatron-patch`` console script's ``main``) and end through ``exit_with``.

    Example::

        run(convert_main)      # a module's __main__; never returns

    A ``SystemExit`` raised on the way (a usage error, a SIGTERM's 143) ends through ``exit_with`` too: it can come
    after gloo collectives as well.
    """
    try:
        status = (command or main)()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            status = 1
    exit_with(status)


if __name__ == "__main__":
    run()
