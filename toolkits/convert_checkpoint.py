"""Hugging Face <-> Megatron checkpoint conversion, verified (same as ``megatron-patch convert``).

Example::

    python toolkits/convert_checkpoint.py hf-to-megatron --hf-dir llama-hf --save-dir llama-mcore
    python toolkits/convert_checkpoint.py megatron-to-hf --load-dir llama-mcore --save-dir llama-hf-again
    python toolkits/convert_checkpoint.py verify --hf-dir llama-hf --megatron-dir llama-mcore \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
"""

from megatron_patch.cli import run
from megatron_patch.convert.cli import main

if __name__ == "__main__":  # dist_checkpointing's writer processes re-import this file
    run(main)
