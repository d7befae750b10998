"""megatron-core imported for a conversion without the parts a conversion never runs: seconds of start-up.

Example::

    from megatron_patch.convert.startup import import_megatron_core
    import_megatron_core()     # first, before compat.apply() imports megatron-core in full
    compat.apply()

``import megatron.core`` imports nearly every subpackage (megatron/core/__init__.py), and two of them cost a
conversion seconds for code it never calls (``python -X importtime``, megatron-core 0.16.1, torch 2.13, about a
third of the process's start-up):

- the fusions (bias-GeLU, SwiGLU, bias-dropout-add, ...) are decorated with ``jit_fuser``, which is
  ``torch.compile`` (megatron/core/jit.py:21), and each decoration imports torch._dynamo and torch._inductor. A
  conversion's models are built with ``ParallelConfig.fused_kernels`` off, so no fused function ever runs;
  megatron-core's own ``disable_jit_fuser`` leaves them plain Python functions (the eager code they compile).
- megatron/core/timers.py:18 imports tensorboard (with fsspec) for ``Timers.write``, under ``try: ... except
  ImportError``; a conversion keeps no timers, so the import is made to fail, as on a machine without tensorboard.

Only a process that has not imported megatron-core yet is affected; one that has keeps what it has.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

# Imported only by Timers.write's SummaryWriter (megatron/core/timers.py:18).
_SKIPPED = "torch.utils.tensorboard"


class _PlainFusions(importlib.abc.MetaPathFinder):
    """Runs ``disable_jit_fuser()`` right after megatron/core/jit.py, before any fusion module is decorated."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_disable(module):
            exec_module(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = exec_then_disable
        return spec


def import_megatron_core() -> None:
    """Import megatron-core with its fusions left uncompiled and without tensorboard (see the module docstring)."""
    if "megatron.core" in sys.modules:
        return
    finder = _PlainFusions()
    sys.meta_path.insert(0, finder)
    skipped = _SKIPPED not in sys.modules
    if skipped:
        sys.modules[_SKIPPED] = None  # an import of it raises ImportError
    try:
        import megatron.core  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
        if skipped:
            del sys.modules[_SKIPPED]
