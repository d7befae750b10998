"""Install megatron_patch: ``pip install -e .[test]``."""

from setuptools import find_packages, setup

setup(
    name="megatron_patch",
    version="0.1.0",
    description="Train GPT and BERT models on megatron-core: data preparation, HF conversion, trainers, recipes",
    # 3.11 resolves megatron-core to 0.16.1; 0.17 and later require Python 3.12.
    python_requires=">=3.11,<3.14",
    packages=find_packages(include=["megatron_patch", "megatron_patch.*", "rapidformer", "rapidformer.*"]),
    install_requires=[
        # megatron-core's own floor (0.16.1 and 0.19.2 both require torch>=2.6.0), no ceiling: the user's torch
        # (a CUDA build, say) is kept, never replaced. CI runs 2.13.0 (CPU) and 2.11.0 (PyPI's CUDA build).
        "torch>=2.6.0",
        "megatron-core>=0.16.1,<0.20",
        "transformers>=5.0,<6",
        "tokenizers>=0.22",
        "sentencepiece>=0.2",
        "regex",
        "safetensors>=0.4",
        "psutil",  # dist_checkpointing's writer processes hang without it
        "isal",  # ISA-L's CRC-32 for checkpoint checksums: zlib's values, about 8x its speed
        "numpy>=1.26",
        "einops",
        "matplotlib",
        # The recipes write TensorBoard logs under --output-dir by default, as Megatron-LM users expect them
        # (torch.utils.tensorboard needs the package).
        "tensorboard",
    ],
    # wandb: --wandb-project, tested in W&B's offline mode; not needed to train.
    # peft: the oracle that loads our exported LoRA adapters (we write its format with safetensors + json).
    # trl: a test oracle only, DPOTrainer's dataset preparation that preprocess-data --dpo must equal.
    # ruff: the linter CI runs before the tests (pyproject.toml's [tool.ruff]).
    extras_require={"test": ["pytest>=8", "pytest-timeout", "wandb", "peft", "trl", "ruff"]},
    entry_points={
        "console_scripts": [
            "megatron-patch=megatron_patch.cli:run",
            "rapidformer=megatron_patch.training.launcher:main",
        ]
    },
)
