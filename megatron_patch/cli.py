"""The ``megatron-patch`` command: one entry point, one subcommand per user step.

Example::

    megatron-patch quickstart
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(module: str, nproc_per_node: int, module_args: list[str]) -> int:
    """Run ``python -m module`` on ``nproc_per_node`` local processes with torch's elastic launcher."""
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
               f"--master-port={port}", "-m", module, *module_args]
    print("+ " + " ".join(command), flush=True)
    return subprocess.run(command).returncode


def _quickstart(args: argparse.Namespace, rest: list[str]) -> int:
    return launch("megatron_patch.quickstart", args.nproc_per_node, rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-patch", description="Train GPT and BERT on megatron-core.")
    commands = parser.add_subparsers(dest="command", required=True)
    quickstart = commands.add_parser(
        "quickstart", help="train a tiny GPT with TP=2 on 2 CPU processes (no download)",
        description="Train a tiny GPT with tensor parallelism on 2 local processes; extra flags "
                    "(--steps N) go to megatron_patch.quickstart.",
    )
    quickstart.add_argument("--nproc-per-node", type=int, default=2)
    quickstart.set_defaults(run=_quickstart)
    args, rest = parser.parse_known_args(argv)
    return args.run(args, rest)


if __name__ == "__main__":
    raise SystemExit(main())
