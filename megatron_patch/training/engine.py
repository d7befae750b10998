"""The engine behind the trainers and the ``rapidformer`` CLI: the run's configuration, distributed start-up, and
composing a model with its optimizer and learning-rate scheduler through its training backend.

Example::

    rapidformer --user-script my_script.py --nproc-per-node 2 --lr 2e-5 --zero-1-memory-optimization

    # my_script.py
    engine = RapidformerEngine()                     # parses the flags, starts the process group, seeds
    model, optimizer, lr_scheduler = engine.compose(model_obj=model)
    loader = engine.build_data_loader(dataset, collate_fn=collate)   # this DP rank's share, on the device

The engine holds the run's typed configuration (``engine.config``, training/config.py) and, for user scripts,
the same values under Megatron-LM's names (``engine.args``, ``get_args()``). megatron-core models (any
``MegatronModule``) are composed by the megatron-core backend (backends/megatron.py: its DDP, optimizer and
sample-counted scheduler), plain torch and Hugging Face models by the plain one (backends/plain.py: the memory mode
of the flags, AdamW, autocast with a loss scaler for ``--mixed-precision``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref

import torch

from megatron_patch.distributed import initialize_distributed
from megatron_patch.training.arguments import parse_run
from megatron_patch.training.config import ArgsView
from megatron_patch.training.backends import backend_for
from megatron_patch.training.schedule import configure_batch_schedule

# The engine the user holds, not an owner of it: an engine the user dropped frees its model, optimizer and process
# groups (a second run in the same process, a reused test worker) instead of living on here until the next one.
_ENGINE: "weakref.ref[Engine] | None" = None


def _current() -> "Engine":
    engine = None if _ENGINE is None else _ENGINE()
    if engine is None:
        raise RuntimeError("no RapidformerEngine alive: create `engine = RapidformerEngine()` and keep it")
    return engine


def get_args() -> ArgsView:
    """The current engine's run under Megatron-LM's names, read-only (for user scripts; our own code reads
    ``engine.config``, which it is made from)."""
    return _current().args


def get_logger() -> logging.Logger:
    return _current().logger


def get_timers() -> "Timers":
    return _current().timers


def get_tokenizer():
    """The tokenizer named by ``--tokenizer-type`` and its files (built on first use)."""
    return _current().tokenizer


class _Timer:
    def __init__(self):
        self._start = None
        self._elapsed = 0.0

    def start(self, barrier: bool = False):
        self._start = time.perf_counter()

    def stop(self, barrier: bool = False):
        self._elapsed += time.perf_counter() - self._start
        self._start = None

    def elapsed(self, reset: bool = True) -> float:
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        return value


class Timers:
    """Megatron-LM's ``timers('name').start() / .stop() / .elapsed()`` on wall-clock time."""

    def __init__(self):
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        return self._timers.setdefault(name, _Timer())


# Padding values for tokenized fields; the others pad with 0 ([PAD] in BERT vocabularies, "masked" in masks).
_PAD_VALUES = {"labels": -100}  # Hugging Face's losses ignore -100


def pad_collate(samples: list):
    """``default_collate`` after right-padding list-valued fields of dict samples to the longest in the batch.

    Example::

        >>> pad_collate([{"input_ids": [2, 7, 3], "labels": 1}, {"input_ids": [2, 3], "labels": 0}])["input_ids"]
        tensor([[2, 7, 3],
                [2, 3, 0]])
    """
    from torch.utils.data import default_collate

    if not samples or not isinstance(samples[0], dict):
        return default_collate(samples)
    padded = [dict(sample) for sample in samples]
    for key, value in samples[0].items():
        if isinstance(value, list):
            longest = max(len(sample[key]) for sample in samples)
            fill = _PAD_VALUES.get(key, 0)
            for sample in padded:
                sample[key] = torch.tensor(sample[key] + [fill] * (longest - len(sample[key])))
    return default_collate(padded)


class _DeviceLoader:
    """A DataLoader whose batches arrive on the engine's device."""

    def __init__(self, loader: torch.utils.data.DataLoader, device: torch.device):
        self.loader = loader
        self.device = device

    def __len__(self):
        return len(self.loader)

    def set_epoch(self, epoch: int):
        self.loader.sampler.set_epoch(epoch)

    def __iter__(self):
        for batch in self.loader:
            yield _to_device(batch, self.device)


def _to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if hasattr(batch, "to") and not isinstance(batch, dict):  # transformers' BatchEncoding
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class Engine:
    """Parses the flags, starts distributed training and composes models; one per process.

    Example::

        engine = Engine(["--micro-batch-size", "4", "--lr", "1e-3"])   # default: sys.argv[1:]
        model, optimizer, scheduler = engine.compose(model_obj=my_torch_module)
        loss = model(batch).loss
        engine.backward(loss)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    """

    def __init__(self, argv: list[str] | None = None):
        global _ENGINE
        self.config, self.args = parse_run(sys.argv[1:] if argv is None else argv)
        config = self.config
        parallel = config.parallel
        self.layout = initialize_distributed(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            seed=config.training.seed,
            timeout_minutes=config.training.distributed_timeout_minutes,
        )
        self.device = self.layout.device
        configure_batch_schedule(config.training, self.layout.rank)
        # Megatron-LM's --exit-duration-in-mins counts from start-up (training.py's _TRAIN_START_TIME).
        self.start_time = time.time()
        self.logger = logging.getLogger("rapidformer")
        if not self.logger.handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("[rapidformer] %(message)s"))
            self.logger.addHandler(handler)
            self.logger.propagate = False
        # The last rank logs, as Megatron-LM's print_rank_last: it holds the last pipeline stage and its loss.
        last = self.layout.rank == self.layout.world_size - 1
        self.logger.setLevel(logging.INFO if last else logging.WARNING)
        if self.layout.rank == 0:
            _record_arguments(format_arguments(self.args), config)
            for notice in config.flag_notices:
                print(f"[rapidformer] {notice}", flush=True)
        self.timers = Timers()
        self._tokenizer = None
        self.backend = None
        _ENGINE = weakref.ref(self)

    # ---------------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from megatron_patch.tokenizer import build_tokenizer

            config = self.config
            if config.tokenizer_type is None:
                raise SystemExit("rapidformer: error: this script needs --tokenizer-type (and its files)")
            self._tokenizer = build_tokenizer(config.tokenizer_type, **dict(config.tokenizer_options))
            if config.checkpoint_info is not None:
                _check_tokenizer_fits(self._tokenizer, config)
        return self._tokenizer

    @property
    def data_parallel_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    # ---------------------------------------------------------------------------------------------------
    def compose(self, model_obj, optimizer=None, lr_scheduler_fn=None, *, train_iters: int | None = None):
        """``(model, optimizer, lr_scheduler)`` ready to train under the flags' precision and memory mode.

        ``lr_scheduler_fn(optimizer=...)`` builds the scheduler (e.g. a ``functools.partial`` of transformers'
        ``get_linear_schedule_with_warmup``); it may also be a ready scheduler object. Without it the scheduler
        follows ``--lr --min-lr --lr-decay-style --lr-warmup-*`` over ``train_iters`` (default ``--train-iters``).
        megatron models come back as a list of DDP chunks.
        """
        self.backend = backend_for(model_obj, self.config, self.device, self.logger)
        return self.backend.compose(model_obj, optimizer, lr_scheduler_fn,
                                    train_iters or self.config.training.train_iters or 1)

    def build_data_loader(self, dataset, batch_size: int | None = None, collate_fn=None, shuffle: bool = True,
                          drop_last: bool = False):
        """This data-parallel rank's share of ``dataset`` in batches of ``--micro-batch-size``, on the device.
        Without ``collate_fn``, tokenized samples (dicts of token lists of different lengths) are padded to the
        longest in the batch (``pad_collate``), as the seed's no-trainer script expects.

        Example::

            loader = engine.build_data_loader(train_dataset, collate_fn=collate)
            for batch in loader: loss = model(**batch).loss
        """
        from megatron.core import parallel_state

        sampler = torch.utils.data.DistributedSampler(
            dataset, num_replicas=parallel_state.get_data_parallel_world_size(),
            rank=parallel_state.get_data_parallel_rank(), shuffle=shuffle, seed=self.config.training.seed,
            drop_last=drop_last,
        )
        # A generator of its own: each pass over a DataLoader draws its workers' base seed from it, which from
        # torch's global one would shift the dropout of every step after an evaluation, and a resume would differ.
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size or self.config.training.micro_batch_size, sampler=sampler,
            collate_fn=collate_fn or pad_collate, num_workers=self.config.data.num_workers, drop_last=drop_last,
            generator=torch.Generator().manual_seed(self.config.training.seed),
        )
        return _DeviceLoader(loader, self.device)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` (dim 0) from every data-parallel rank, for metrics."""
        group = self.data_parallel_group
        size = torch.distributed.get_world_size(group)
        if size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scaled for fp16 (the optimizer unscales before stepping)."""
        if self.backend is None:
            loss.backward()
        else:
            self.backend.backward(loss)

    def print_rank_0(self, message: str) -> None:
        self.logger.info(message)


def format_arguments(args, title: str = "arguments") -> str:
    """Every effective setting in Megatron-LM's block (``_print_args`` of megatron/training/arguments.py): one
    ``  name .... value`` line each, dots up to column 48, sorted ignoring case, between two rulers.

    Example::

        print(format_arguments(argparse.Namespace(lr=0.001)))
        # ------------------------ arguments ------------------------
        #   lr .............................................. 0.001
        # -------------------- end of arguments ---------------------
    """
    lines = sorted((f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()),
                   key=str.lower)
    return "\n".join([f"------------------------ {title} ------------------------", *lines,
                      f"-------------------- end of {title} ---------------------"])


def _record_arguments(block: str, config) -> None:
    """Megatron-LM's arguments block written to ``arguments.txt`` in the run's log directory (``--log-dir``, else
    ``--tensorboard-dir``, else ``--save``) and said in one line; printed whole only with ``--debug``. It was ~210
    of a short run's ~220 lines, in front of any error.

    Example::

        _record_arguments(format_arguments(args), config)   # [rapidformer] arguments: out/logs/arguments.txt
    """
    from megatron_patch.errors import debugging

    directory = config.logging.log_dir or config.logging.tensorboard_dir or config.checkpointing.save
    if directory:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "arguments.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(block + "\n")
        print(f"[rapidformer] arguments: {path}", flush=True)
    if debugging():
        print(block, flush=True)


def _check_tokenizer_fits(tokenizer, config) -> None:
    """Refuse a tokenizer whose ids the ``--load`` checkpoint cannot embed, before any step.

    A Hugging Face model's vocabulary may be larger than its tokenizer's (rows kept for added tokens); one our
    trainer started from scratch was sized by its tokenizer, so another size means another tokenizer.
    """
    from megatron_patch.checkpoint.format import find_info
    from megatron_patch.tokenizer.registry import padded_vocab_size

    info = config.checkpoint_info
    stored = info.model_config.vocab_size
    given = tokenizer.vocab_size

    def source() -> str:  # read again only to name it in a refusal
        # The description's file: megatron_patch_args.json, or the common.pt or rank file of a Megatron-LM save.
        return find_info(config.checkpointing.load)[1]

    if not info.vocab_size_known:  # Megatron-LM's args name the padded rows only: the tokenizer must pad to them
        tp = info.tensor_model_parallel_size
        rows = padded_vocab_size(given, info.model_config.make_vocab_size_divisible_by, tp)
        if rows != info.padded_vocab_size:
            raise SystemExit(
                f"rapidformer: error: --tokenizer-type {config.tokenizer_type} has {given} tokens, {rows} rows at "
                f"TP={tp}, but {source()} stores {info.padded_vocab_size} rows: the checkpoint was trained with "
                "another tokenizer; give that tokenizer's files (--vocab-file/--merge-file/--tokenizer-model)")
        return
    if given > stored or (info.hf_config is None and given != stored):
        raise SystemExit(
            f"rapidformer: error: --tokenizer-type {config.tokenizer_type} has {given} tokens but {source()} describes "
            f"a vocabulary of {stored}: the checkpoint was trained with another tokenizer; give that tokenizer's files "
            "(--vocab-file/--merge-file/--tokenizer-model) or, for a NullTokenizer, its --vocab-size"
        )


RapidformerEngine = Engine
