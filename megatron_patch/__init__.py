"""megatron_patch: train GPT and BERT models on megatron-core, from JSONL to a Hugging Face checkpoint.

Example::

    megatron-patch quickstart          # tiny GPT, 2 processes, CPU, no download

Importing the package checks that the installed megatron-core is the release it was verified against.
"""

from megatron_patch.compat import check_megatron_core_version

__version__ = "0.1.0"

check_megatron_core_version()
