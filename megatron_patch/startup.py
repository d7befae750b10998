"""What every process of ours pays before its work, made cheaper: importing torch, megatron-core, transformers.

Example::

    from megatron_patch.startup import import_libraries, paused_collector
    import_libraries()            # torch, the CPU shim (compat.apply) and megatron-core, the collector paused
    with paused_collector():      # transformers imports a model class's module at its first use
        model = AutoModelForCausalLM.from_pretrained("llama-hf")

Importing torch and megatron-core makes about 700,000 objects, and every one of them lives as long as the process.
CPython's cyclic garbage collector runs on allocation counts, so it walks them again and again while they are
being made: on this machine 0.2-0.75 s of a 2-3.7 s import (0.15 s of torch's, the rest megatron-core's), in every
rank, conversion and test worker, and 0.8 s of the 2.9 s transformers takes to import a model class. Modules are
not garbage, so pausing the collector for the imports loses nothing; it runs again, with its usual thresholds, as
soon as they are done.

Resuming alone would still have the collector walk them all twice more: the objects made while it was paused wait in
its youngest generation, which its next run, a few hundred allocations later, walks whole, and the run after ten of
those walks the next generation. So they go straight to the oldest generation, which only the rare full collection
walks: 0.25-0.3 s less of a rank's start-up here.
"""

from __future__ import annotations

import contextlib
import gc

from megatron_patch.compat import process_froze_objects


@contextlib.contextmanager
def paused_collector():
    """Run the block without Python's cyclic garbage collector; afterwards it is on again if it was before, and every
    object then alive (the block's among them) is in the collector's oldest generation.

    Example::

        >>> import gc
        >>> with paused_collector():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not process_froze_objects():  # unfreezing would also thaw what the process froze itself
            # Moves every tracked object to the permanent generation and back into the oldest one, without a walk.
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


def import_libraries() -> None:
    """Import torch and megatron-core with the collector paused, megatron-core after the CPU shim's view of torch
    is in place (``compat.apply``, which on a machine without CUDA imports both itself)."""
    with paused_collector():
        from megatron_patch import compat

        compat.apply()
        import megatron.core  # noqa: F401  (with CUDA, compat.apply imports none of it)
