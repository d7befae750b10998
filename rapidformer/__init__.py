"""Rapidformer's API on megatron_patch: the engine, the trainer templates and the helpers its scripts import.

Example::

    from rapidformer import RapidformerEngine, get_args, Finetuner
    engine = RapidformerEngine()
    MyFinetuner(engine=engine).train()

Importing this package also makes ``from megatron import mpu`` work (see megatron_patch.training.mpu).
"""

from megatron_patch import compat as _compat

_compat.apply()

from megatron_patch.training import mpu as _mpu  # noqa: E402
from megatron_patch.training.data import (  # noqa: E402
    SequenceClassificationMetric,
    build_train_valid_test_datasets,
    build_train_valid_test_datasets_for_huggingface,
    get_ltor_masks_and_position_ids,
    load_sentence_pair_dataset,
)
from megatron_patch.training.engine import (  # noqa: E402
    Engine,
    RapidformerEngine,
    get_args,
    get_logger,
    get_timers,
    get_tokenizer,
)
from megatron_patch.training.trainers import Finetuner, PreTrainer, Pretrainer  # noqa: E402

_mpu.install()
mpu = _mpu

__all__ = [
    "Engine", "Finetuner", "PreTrainer", "Pretrainer", "RapidformerEngine", "SequenceClassificationMetric",
    "build_train_valid_test_datasets", "build_train_valid_test_datasets_for_huggingface", "get_args",
    "get_logger", "get_ltor_masks_and_position_ids", "get_timers", "get_tokenizer", "load_sentence_pair_dataset",
    "mpu",
]
