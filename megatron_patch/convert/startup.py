"""megatron-core imported for a conversion without tensorboard, which a conversion never uses.

Example::

    from megatron_patch.convert.startup import import_megatron_core
    import_megatron_core()     # first, before compat.apply() imports megatron-core in full
    compat.apply()

``import megatron.core`` imports nearly every subpackage (megatron/core/__init__.py). Its fusions no longer cost
an import of torch._dynamo (the package compiles them on first call: ``compat.compile_fusions_on_first_call``),
but megatron/core/timers.py still imports tensorboard (with fsspec) for ``Timers.write``, under ``try: ...
except ImportError``; a conversion keeps no timers, so the import is made to fail, as on a machine without
tensorboard. Only a process that has not imported megatron-core yet is affected; one that has keeps what it has.
The import runs with the garbage collector paused (:mod:`megatron_patch.startup`).
"""

from __future__ import annotations

import sys

from megatron_patch.startup import paused_collector

# Imported only by Timers.write's SummaryWriter (megatron/core/timers.py, at its import).
_SKIPPED = "torch.utils.tensorboard"


def import_megatron_core() -> None:
    """Import megatron-core without tensorboard (see the module docstring)."""
    if "megatron.core" in sys.modules:
        return
    skipped = _SKIPPED not in sys.modules
    if skipped:
        sys.modules[_SKIPPED] = None  # an import of it raises ImportError
    try:
        with paused_collector():
            import megatron.core  # noqa: F401
    finally:
        if skipped:
            del sys.modules[_SKIPPED]
