"""What every process of ours pays before its work, made cheaper (importing torch, megatron-core, transformers) and
quieter (the upstream warnings we know about).

Example::

    from megatron_patch.startup import import_libraries, paused_collector
    import_libraries()            # torch, the CPU shim (compat.apply) and megatron-core, the collector paused
    with paused_collector():      # transformers imports a model class's module at its first use
        model = AutoModelForCausalLM.from_pretrained("llama-hf")

Importing the package silences the upstream warnings and log records listed in ``KNOWN_WARNINGS`` and
``KNOWN_LOG_RECORDS`` (``quiet_known_noise``), each with the reason it tells our users nothing they can act on;
``megatron-patch --debug`` or ``MEGATRON_PATCH_DEBUG=1`` shows them again, in every rank.

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
import functools
import gc
import logging
import warnings

from megatron_patch.compat import process_froze_objects
from megatron_patch.errors import debugging

# (category, message pattern, why it is silenced) of upstream warnings.
KNOWN_WARNINGS = (
    (UserWarning, r".*(Transformer Engine|Apex|apex).*(not installed|Falling back).*",
     "megatron-core warns at import, once per module, that TE/apex are missing; our spec builder makes the choice "
     "between TE and local layers and reports it"),
    (DeprecationWarning, r"The following imports from `dynamic_context.py` will be removed",
     "megatron/core/inference/contexts/__init__.py (0.16.1 and 0.19.2) about its own imports, raised whenever "
     "megatron-core's models import it"),
    (FutureWarning, r"`load_state_dict` is deprecated and will be removed in future versions",
     "megatron-core's torch_dist loader calls torch DCP's load_state_dict (TorchDistLoadShardedStrategy.load in "
     "0.16.1) at every checkpoint load"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     "megatron-core's torch_dist checkpoints are made of ShardedTensors (0.16.1 and 0.19.2), so torch DCP warns at "
     "every save and load; the format is megatron-core's to change"),
    (UserWarning, r"MimoModelConfig is experimental",
     "megatron-core 0.19.2 warns when its models package imports models/mimo (mimo/config/base_configs.py); no "
     "MIMO model is built here"),
    (UserWarning, r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) "
                  r"in a single process",
     "torch DCP (distributed/checkpoint/utils.py) in a converter's single process, where that is the intent"),
    (UserWarning, r"absl.logging is not installed",
     "megatron-core 0.19's hyper_comm_grid.py warns at import, in every process, that it logs through the standard "
     "logging module instead of absl's; nothing here reads absl's logs"),
    (UserWarning, r"Could not determine rank from torch.distributed, RANK, or SLURM_PROCID",
     "megatron-core 0.19's _rank_utils, when it logs outside a rank: the launcher, which checks a resumed "
     "checkpoint's learning-rate schedule with megatron-core's OptimizerParamScheduler before any rank starts"),
    (FutureWarning, r"`torch.distributed.all_gather_into_tensor` is deprecated",
     "torch 2.13 deprecates the collective megatron-core 0.16.1's tensor-parallel gathers call "
     "(tensor_parallel/mappings.py, dist_all_gather_func), in every TP rank; the call is megatron-core's to change"),
    (UserWarning, r"The argument order of load has been changed",
     "torch 2.11's DCP warns at every dcp.load with keyword arguments (distributed/checkpoint/logger.py), which is "
     "how the converters call it"),
)
# (logger, start of the message, why it is dropped) of upstream log records.
KNOWN_LOG_RECORDS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED",
     "0.19.2 logs it at every GPTModel built (GPTModel.__init__); its successor HybridModel is not in "
     "0.16.1, which CI also runs, and GPTModel is what Megatron-LM's GPT checkpoints and our converters are laid "
     "out for"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated",
     "0.19.2 logs it once per process for every save, synchronous ones included "
     "(TorchDistSaveShardedStrategy.async_save); ours must stay on megatron-core's writer (compat.async_save_options)"),
    ("megatron.core.dist_checkpointing.strategies.common", "load_common is deprecated",
     "0.19.2 logs it at every read of a common.pt (strategies/common.py, load_common), which is how it reads every "
     "checkpoint 0.16.1 or Megatron-LM on it saved"),
    ("megatron.core.datasets.gpt_dataset", "Unable to save Mock",
     "--mock-data's indexes are made in memory in a moment; there is nothing to cache "
     "(GPTDataset._build_document_sample_shuffle_indices, once per split)"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found",
     "PyPI's CUDA build of torch logs it on a machine without a GPU when megatron-core imports cpp_extension "
     "(at the import of torch/utils/cpp_extension.py); nothing here runs on CUDA then"),
    ("megatron.core.datasets.megatron_tokenizer", "You're using the legacy tokenizer system",
     "megatron-core 0.16.1's MegatronLegacyTokenizer logs it at every tokenizer built; our tokenizers "
     "(tokenizer/base.py) do not use it, Megatron-LM's own do"),
)


# Upstream warnings that mean something on GPUs only: (category, message, why), silenced on a machine without CUDA.
KNOWN_CPU_WARNINGS = (
    (UserWarning, r"When using (async grad allreduce|sequence parallelism) it is recommended to set the environment "
                  r"variable CUDA_DEVICE_MAX_CONNECTIONS",
     "megatron-core's tensor_parallel/layers.py (linear_with_grad_accumulation_and_async_allreduce, 0.16.1 and 0.19) "
     "asks for CUDA's connection count once per rank; a CPU run has no CUDA streams to order"),
)


def quiet_cpu_noise() -> None:
    """Silence ``KNOWN_CPU_WARNINGS`` unless debugging: for a rank that runs on CPU.

    Example::

        if not torch.cuda.is_available():
            quiet_cpu_noise()
    """
    if not debugging():
        for category, message, _ in KNOWN_CPU_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)


def quiet_known_noise() -> None:
    """Silence ``KNOWN_WARNINGS`` and ``KNOWN_LOG_RECORDS`` (once, at the package's import) unless debugging.

    Example::

        quiet_known_noise()     # megatron_patch/__init__.py
        show_known_noise()      # megatron-patch --debug, after the package is imported
    """
    if not debugging():
        for category, message, _ in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
    for logger, start, _ in KNOWN_LOG_RECORDS:
        # Checked at each record, so that --debug given after the import shows them.
        logging.getLogger(logger).addFilter(functools.partial(_shown, start))


def show_known_noise() -> None:
    """Show ``KNOWN_WARNINGS`` again (``--debug``): a filter that shows each, ahead of the one that hid it."""
    for category, message, _ in KNOWN_WARNINGS:
        warnings.filterwarnings("default", message=message, category=category)


def _shown(start: str, record: logging.LogRecord) -> bool:
    return debugging() or not record.getMessage().startswith(start)


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
