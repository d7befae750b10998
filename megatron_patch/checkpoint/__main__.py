"""What a shell script asks of a checkpoint directory, so that the recipes (run_scripts/common.sh) do not repeat the
file names ``checkpoint.format`` defines: the path of the directory's tracker or description file, when it has one.

Example::

    python -m megatron_patch.checkpoint tracker output/gpt-tiny/checkpoints
    # output/gpt-tiny/checkpoints/latest_checkpointed_iteration.txt; exit status 1, and nothing printed, without one
    python -m megatron_patch.checkpoint description output/gpt-tiny/checkpoints
    # output/gpt-tiny/checkpoints/megatron_patch_args.json, likewise

The tracker says the directory holds a checkpoint to resume from; the description (``CheckpointInfo``) says which
model it holds, so a recipe need not name one.
"""

from __future__ import annotations

import os
import sys

from megatron_patch.checkpoint.format import ARGS_FILE, TRACKER_FILE
from megatron_patch.errors import FlagParser

FILES = {"tracker": TRACKER_FILE, "description": ARGS_FILE}


def main(argv: list[str] | None = None) -> int:
    """Print the path of ``directory``'s file of the kind asked for and return 0; return 1 when it has none.

    Example::

        >>> main(["tracker", "/nonexistent"])
        1
    """
    parser = FlagParser(prog="python -m megatron_patch.checkpoint",
                                     description="Print the path of a checkpoint directory's tracker or description "
                                                 "file; exit status 1 when it has none.")
    parser.add_argument("file", choices=FILES, help=", ".join(f"{kind}: {name}" for kind, name in FILES.items()))
    parser.add_argument("directory")
    args = parser.parse_args(argv)
    path = os.path.join(args.directory, FILES[args.file])
    if not os.path.isfile(path):
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
