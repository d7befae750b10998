"""Hugging Face <-> Megatron checkpoint conversion that verifies itself.

Example::

    megatron-patch convert hf-to-megatron --hf-dir llama-hf --save-dir llama-mcore
    megatron-patch convert verify --hf-dir llama-hf --megatron-dir llama-mcore --tensor-model-parallel-size 2
    megatron-patch convert megatron-to-hf --load-dir llama-mcore --save-dir llama-hf-again

The mapping tables are each family's (``megatron_patch.model.families``, registered by ``model_type`` in
``megatron_patch.model.conversion``); ``transforms`` holds the named layout transforms,
``hf_io`` the Hugging Face files, ``core`` the conversions, ``lora`` and ``peft`` a LoRA checkpoint's adapters out
to PEFT's files and in from them, ``verify`` the numerical check. The Megatron side's files (torch_dist,
Megatron-LM's per-rank files, their description) are :mod:`megatron_patch.checkpoint`'s, which the trainer reads and
writes too.
"""
