"""The two training backends, one interface: megatron-core model chunks (backends/megatron.py) and plain torch /
Hugging Face modules (backends/plain.py). Each composes a model with its optimizer and scheduler, steps,
evaluates, saves and loads (through ``checkpoint.megatron`` and ``checkpoint.plain``, which hold the file I/O); the
trainers keep only the loop and the hooks.

Example::

    backend = backend_for(model, config, device, logger)      # MegatronBackend for any MegatronModule
    model, optimizer, scheduler = backend.compose(model, None, None, train_iters=100)
"""

from __future__ import annotations

import logging

import torch

from megatron_patch.training.backends.megatron import MegatronBackend, is_megatron_model
from megatron_patch.training.backends.plain import PlainBackend
from megatron_patch.training.config import RunConfig


def backend_for(model_obj, config: RunConfig, device: torch.device, logger: logging.Logger
                ) -> MegatronBackend | PlainBackend:
    """The backend that trains ``model_obj``: megatron-core's for megatron-core modules (or lists of them, one per
    virtual pipeline stage), the plain one for any other ``torch.nn.Module``."""
    backend = MegatronBackend if is_megatron_model(model_obj) else PlainBackend
    return backend(config, device, logger)


__all__ = ["MegatronBackend", "PlainBackend", "backend_for", "is_megatron_model"]
