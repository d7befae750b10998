"""Megatron checkpoint files, below both the trainer (``training/``) and the converter (``convert/``).

Example::

    from megatron_patch.checkpoint.format import read_info
    from megatron_patch.checkpoint.load import load_into_chunks
    info = read_info("llama-mcore")                   # megatron_patch_args.json, else Megatron-LM's own args
    load_into_chunks(chunks, "llama-mcore", info)     # either format, into this rank's chunks at any TP/PP

``format``: file names, the tracker, the description (CheckpointInfo) and Megatron-LM's ``args``, the dtype table.
``torch_dist``: megatron-core's dist_checkpointing as full tensors (``direct_io``: its data files around the page
cache). ``legacy``: Megatron-LM's per-rank ``mp_rank_*/model_optim_rng.pt`` files, cut and merged along TP/PP.
``load``: a checkpoint's model, either format, into chunks at any layout. ``integrity``: staged, checksummed,
atomically published saves and their verification.

The trainer's checkpoints, the only ones its backends read or write: ``megatron`` (megatron-core chunks with their
optimizer and scheduler: ``save_megatron_checkpoint``, ``load_megatron_checkpoint``), ``plain`` (plain torch /
Hugging Face models: ``save_plain_checkpoint``, ``load_plain_checkpoint``), both through ``trainer`` (staging, RNG
state, publishing, the checkpoint a ``--load`` resumes from, ``--load-fallback``). Nothing here imports
``training`` or ``convert`` (tests/test_architecture.py).
"""
