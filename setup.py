"""Install megatron_patch: ``pip install -e .[test]``."""

from setuptools import find_packages, setup

setup(
    name="megatron_patch",
    version="0.1.0",
    description="Train GPT and BERT models on megatron-core: data preparation, HF conversion, trainers, recipes",
    python_requires="==3.11.*",
    packages=find_packages(include=["megatron_patch", "megatron_patch.*", "rapidformer", "rapidformer.*"]),
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
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
    ],
    # tensorboard: --tensorboard-dir writes through torch.utils.tensorboard, which needs it (tests read the events).
    extras_require={"test": ["pytest>=8", "pytest-timeout", "tensorboard"]},
    entry_points={
        "console_scripts": [
            "megatron-patch=megatron_patch.cli:run",
            "rapidformer=megatron_patch.training.launcher:main",
        ]
    },
)
