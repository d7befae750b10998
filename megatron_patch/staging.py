"""Temporary names that say which process writes them, and finding those a killed process left behind.

Example::

    from megatron_patch.staging import killed_leftovers, staging_tag, tag_pattern
    tmp = "out/llama-mcore" + staging_tag("partial")         # out/llama-mcore.partial-node1-4242
    for path, pid, _ in killed_leftovers("out", r"llama-mcore" + tag_pattern("partial")):
        shutil.rmtree(path)                                   # only if process 4242 of node1 is gone

Our commands write under a temporary name and rename the result into place, so a failure leaves nothing under the
final name, and cleanup removes the temporary files. A SIGKILL (the out-of-memory killer, a scheduler's hard limit)
runs no cleanup: what the process was writing, as large as a model or a dataset, stays. The next run into the same
place removes it. The tag names the host as well as the pid: on a shared file system only the host that ran a
process can tell that it is gone.
"""

from __future__ import annotations

import os
import re
import socket


def staging_tag(kind: str) -> str:
    """``.KIND-HOST-PID`` for this process, e.g. ``.partial-node1-4242``."""
    return f".{kind}-{socket.gethostname()}-{os.getpid()}"


def tag_pattern(kind: str) -> str:
    """The regex of :func:`staging_tag` on this host for any pid (group ``pid``); ``kind`` may be a regex too.

    Example::

        >>> import re
        >>> bool(re.fullmatch("out" + tag_pattern("tmp|old"), "out" + staging_tag("old")))
        True
    """
    return rf"\.(?:{kind})-{re.escape(socket.gethostname())}-(?P<pid>\d+)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def killed_leftovers(directory: str, pattern: str) -> list[tuple[str, int, re.Match]]:
    """The entries of ``directory`` whose whole name matches ``pattern`` (built with :func:`tag_pattern`) and
    whose process is no longer running on this host: ``(path, pid, match)``, in name order."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        match = re.fullmatch(pattern, name)
        if match is not None and not _alive(int(match["pid"])):
            found.append((os.path.join(directory, name), int(match["pid"]), match))
    return found
