"""Models by name or by flags, built on megatron-core for any parallel layout.

Example::

    from megatron_patch.model import ParallelConfig, build_model_chunks, get_model_config, padded_vocab_size
    model_config = get_model_config("tiny-llama", num_layers=4)
    chunks = build_model_chunks(model_config, ParallelConfig(), padded_vocab_size(128, 1, 1))
"""

from megatron_patch.model.config import (
    ModelConfig,
    add_model_arguments,
    get_model_config,
    list_model_configs,
    model_config_from_args,
    register_model_config,
)
from megatron_patch.model.flops import num_floating_point_operations, num_parameters
from megatron_patch.model.parallel import ParallelConfig, add_parallel_arguments, parallel_config_from_args
# Every family's model types and named configurations, registered by importing its file.
from megatron_patch.model import families  # noqa: F401, E402

__all__ = [
    "ModelConfig", "ParallelConfig", "add_model_arguments", "add_parallel_arguments", "get_model_config",
    "list_model_configs", "model_config_from_args", "num_floating_point_operations", "num_parameters",
    "parallel_config_from_args", "register_model_config",
]
