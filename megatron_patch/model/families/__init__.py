"""The model families, one file each: a family's Hugging Face model types, its named configurations (``--model-name``),
its config.json in and out, its tensor rules and what verify compares. Importing this package registers them all
(``megatron_patch.model`` does).

Example::

    from megatron_patch.model.config import get_model_config
    get_model_config("qwen3-0.6b")                  # registered by families/llama.py

A new family is one more file here and its line below; what it shares with others (RoPE variants, biases, q/k norms,
experts) is in ``megatron_patch.model.features``.
"""

# Each registers itself; in this order, the converter's registry lists them as it always has.
from megatron_patch.model.families import gpt2, llama, moe, deepseek, bert, phi3, gemma3  # noqa: F401
