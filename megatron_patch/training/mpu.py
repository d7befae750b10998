"""``from megatron import mpu`` for Rapidformer-era scripts: megatron-core's parallel state plus
``broadcast_data``, under the old module name.

Example::

    from megatron import mpu                     # works inside `rapidformer --user-script ...`
    data = mpu.broadcast_data(["text"], batch_or_none, torch.int64)   # TP rank 0's batch on every TP rank

megatron-core owns the ``megatron`` namespace package (no ``__init__.py``), so rather than shipping files into
it we register this module as ``megatron.mpu`` at run time (``install``), which works the same for editable and
normal installs.
"""

import sys

from megatron.core.parallel_state import *  # noqa: F401,F403  (the old mpu exposed every group getter)
from megatron.core.tensor_parallel import broadcast_data  # noqa: F401


def install() -> None:
    """Make ``from megatron import mpu`` and ``import megatron.mpu`` resolve to this module."""
    import megatron

    module = sys.modules[__name__]
    sys.modules["megatron.mpu"] = module
    megatron.mpu = module
