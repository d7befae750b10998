"""megatron_patch: train GPT and BERT models on megatron-core, from JSONL to a Hugging Face checkpoint.

Example::

    megatron-patch quickstart          # tiny GPT, 2 processes, CPU, no download

Importing the package checks that the installed megatron-core is the release it was verified against, and has
megatron-core, whenever it is imported, compile its fused functions on their first call rather than at its import
(``compat.compile_fusions_on_first_call``: seconds of every process's start-up). It also silences the upstream
warnings we know about (``startup.quiet_known_noise``; ``--debug`` shows them).
"""

from megatron_patch.compat import check_megatron_core_version, compile_fusions_on_first_call
from megatron_patch.startup import quiet_known_noise

__version__ = "0.1.0"

check_megatron_core_version()
compile_fusions_on_first_call()
quiet_known_noise()
