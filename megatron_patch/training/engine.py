"""The engine behind the trainers and the ``rapidformer`` CLI: arguments, distributed start-up, and composing a
model with its optimizer and learning-rate scheduler.

Example::

    rapidformer --user-script my_script.py --nproc-per-node 2 --lr 2e-5 --zero-1-memory-optimization

    # my_script.py
    engine = RapidformerEngine()                     # parses the flags, starts the process group, seeds
    model, optimizer, lr_scheduler = engine.compose(model_obj=model)
    loader = engine.build_data_loader(dataset, collate_fn=collate)   # this DP rank's share, on the device

megatron-core models (any ``MegatronModule``) get megatron-core's DDP (with ``Float16Module`` for fp16/bf16),
its optimizer (distributed with ``--zero-1/2-memory-optimization`` or ``--use-distributed-optimizer``) and
``OptimizerParamScheduler`` counted in samples, as in Megatron-LM. Plain torch and Hugging Face models get the
memory mode of the flags (``MEMORY_WRAPPERS``), AdamW (fused on GPUs, foreach on CPUs) and autocast with a
dynamic loss scaler for ``--mixed-precision``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import sys
import time
from typing import Callable

import torch

from megatron_patch.distributed import initialize_distributed
from megatron_patch.training.arguments import parse_args
from megatron_patch.training.schedule import build_scheduler, configure_batch_schedule

_ENGINE: "Engine | None" = None


def _current() -> "Engine":
    if _ENGINE is None:
        raise RuntimeError("no RapidformerEngine yet: create `engine = RapidformerEngine()` first")
    return _ENGINE


def get_args() -> argparse.Namespace:
    """The parsed flags of the current engine (for user scripts; our own code takes explicit values)."""
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


class PlainOptimizer:
    """A torch optimizer with loss scaling and gradient clipping, stepping like megatron-core's optimizers.

    ``step()`` returns ``(update_successful, grad_norm, None)``. The loss is unscaled only when it went through
    ``engine.backward`` (a user script calling ``loss.backward()`` itself is not scaled, so nothing is undone).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: list, clip_grad: float,
                 scaler: torch.amp.GradScaler | None):
        self.optimizer = optimizer
        self.parameters = parameters
        self.clip_grad = clip_grad
        self.scaler = scaler
        self.scaled = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        self.scaled = True
        return self.scaler.scale(loss)

    def get_loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaled else 1.0

    def step(self):
        if self.scaled:
            self.scaler.unscale_(self.optimizer)
        grads = [p for p in self.parameters if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(grads, self.clip_grad if self.clip_grad > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not self.scaled:
            if not math.isfinite(grad_norm):  # bf16/fp32 have no scaler to skip a NaN/Inf step; skip it here
                return False, grad_norm, None
            self.optimizer.step()
            return True, grad_norm, None
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scaled = False
        # GradScaler skips the step and lowers the scale when gradients overflowed.
        return self.scaler.get_scale() >= scale, grad_norm, None

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


class IterationScheduler:
    """megatron-core's ``OptimizerParamScheduler`` stepped once per optimiser step (``step()`` takes no count,
    as torch schedulers do, so user scripts can call it the usual way)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, increment: int = 1):
        self.scheduler.step(increment)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.scheduler.optimizer.param_groups]

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)


def _layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model (elements of every ModuleList): FSDP2's units of sharding."""
    return [layer for module in model.modules() if isinstance(module, torch.nn.ModuleList) for layer in module]


def _wrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    if torch.distributed.get_world_size() == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model)


def _wrap_fsdp(model: torch.nn.Module, reshard_after_forward: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in _layer_modules(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


# memory mode -> how a plain/HF model is wrapped (see arguments.MEMORY_HELP for what each mode promises).
MEMORY_WRAPPERS: dict[str | None, Callable[[torch.nn.Module], torch.nn.Module]] = {
    None: _wrap_ddp,
    "zero-1": _wrap_ddp,
    "zero-2": functools.partial(_wrap_fsdp, reshard_after_forward=False),
    "zero-3": functools.partial(_wrap_fsdp, reshard_after_forward=True),
    "fsdp": functools.partial(_wrap_fsdp, reshard_after_forward=True),
}


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


def is_megatron_model(model_obj) -> bool:
    from megatron.core.transformer.module import MegatronModule

    chunks = model_obj if isinstance(model_obj, (list, tuple)) else [model_obj]
    return all(isinstance(chunk, MegatronModule) for chunk in chunks)


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
        self.args = parse_args(sys.argv[1:] if argv is None else argv)
        args = self.args
        self.layout = initialize_distributed(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            seed=args.seed,
            timeout_minutes=args.distributed_timeout_minutes,
        )
        self.device = self.layout.device
        dp = self.layout.data_parallel_size
        if args.global_batch_size is None:
            args.global_batch_size = args.micro_batch_size * dp
        if args.global_batch_size % (args.micro_batch_size * dp):
            raise SystemExit(
                f"rapidformer: error: --global-batch-size {args.global_batch_size} is not a multiple of "
                f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}"
            )
        args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
        args.data_parallel_size = dp
        args.rank, args.world_size = self.layout.rank, self.layout.world_size
        args.local_rank = self.layout.local_rank
        configure_batch_schedule(args, self.layout.rank, dp)
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
            print(format_arguments(args), flush=True)
            for notice in args.flag_notices:
                print(f"[rapidformer] {notice}", flush=True)
        self.timers = Timers()
        self._tokenizer = None
        self.optimizer = None
        _ENGINE = self

    # ---------------------------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from megatron_patch.tokenizer import build_tokenizer
            from megatron_patch.tokenizer.registry import tokenizer_options

            if self.args.tokenizer_type is None:
                raise SystemExit("rapidformer: error: this script needs --tokenizer-type (and its files)")
            options = {k: v for k, v in tokenizer_options(self.args).items() if v is not None}
            self._tokenizer = build_tokenizer(self.args.tokenizer_type, **options)
            if self.args.checkpoint_info is not None:
                _check_tokenizer_fits(self._tokenizer, self.args.checkpoint_info, self.args)
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
        compose = _compose_megatron if is_megatron_model(model_obj) else _compose_plain
        model, optimizer, scheduler = compose(self, model_obj, optimizer, lr_scheduler_fn,
                                              train_iters or self.args.train_iters or 1)
        self.optimizer = optimizer
        return model, optimizer, scheduler

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
            rank=parallel_state.get_data_parallel_rank(), shuffle=shuffle, seed=self.args.seed,
            drop_last=drop_last,
        )
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size or self.args.micro_batch_size, sampler=sampler,
            collate_fn=collate_fn or pad_collate, num_workers=self.args.num_workers, drop_last=drop_last,
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
        scaled = self.optimizer.scale_loss(loss) if self.optimizer is not None else loss
        scaled.backward()

    def print_rank_0(self, message: str) -> None:
        self.logger.info(message)


def format_arguments(args: argparse.Namespace, title: str = "arguments") -> str:
    """Every effective setting in Megatron-LM's block (``_print_args`` of megatron/training/arguments.py): one
    ``  name .... value`` line each, dots up to column 48, sorted ignoring case, between two rulers.

    Example::

        print(format_arguments(argparse.Namespace(lr=0.001)))
        # ------------------------ arguments ------------------------
        #   lr .............................................. 0.001
        # -------------------- end of arguments ---------------------
    """
    settings = {name: value for name, value in vars(args).items() if not name.startswith("_switch_")}
    # Switch flags keep their value under a private name (model.config._SWITCH_FLAGS); show the flag's name.
    settings.update({name[len("_switch_"):]: value for name, value in vars(args).items()
                     if name.startswith("_switch_")})
    lines = sorted((f"  {name} {'.' * (48 - len(name))} {value}" for name, value in settings.items()), key=str.lower)
    return "\n".join([f"------------------------ {title} ------------------------", *lines,
                      f"-------------------- end of {title} ---------------------"])


def _check_tokenizer_fits(tokenizer, info, args) -> None:
    """Refuse a tokenizer whose ids the ``--load`` checkpoint cannot embed, before any step.

    A Hugging Face model's vocabulary may be larger than its tokenizer's (rows kept for added tokens); one our
    trainer started from scratch was sized by its tokenizer, so another size means another tokenizer.
    """
    from megatron_patch.checkpoint.format import ARGS_FILE

    stored = info.model_config.vocab_size
    given = tokenizer.vocab_size
    if given > stored or (info.hf_config is None and given != stored):
        raise SystemExit(
            f"rapidformer: error: --tokenizer-type {args.tokenizer_type} has {given} tokens but "
            f"{os.path.join(args.load, ARGS_FILE)} records vocab_size={stored}: the checkpoint was trained with "
            "another tokenizer; give that tokenizer's files (--vocab-file/--merge-file/--tokenizer-model)"
        )


def _plain_autocast_dtype(args) -> torch.dtype | None:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def _compile(model: torch.nn.Module, backend: str, logger: logging.Logger) -> None:
    logger.info(f"--onnx-runtime-training: ONNX Runtime training is unmaintained upstream, so the model's "
                f"forward is compiled with torch.compile(backend={backend!r}) instead")
    model.compile(backend=backend)


def _user_scheduler(lr_scheduler_fn, optimizer, default: Callable[[], object]):
    """``compose``'s ``lr_scheduler_fn``: None -> ``default()``; a factory such as
    ``partial(get_linear_schedule_with_warmup, ...)`` -> called with the optimizer; a scheduler -> itself."""
    if lr_scheduler_fn is None:
        return default()
    if callable(lr_scheduler_fn) and not hasattr(lr_scheduler_fn, "step"):
        return lr_scheduler_fn(optimizer=optimizer)
    return lr_scheduler_fn


# Flags that act on megatron-core's DDP, optimizer, scheduler or pipeline schedules: (flag, whether it is given).
_MEGATRON_ONLY_FLAGS = [
    ("--train-samples", lambda a: a.train_samples is not None),
    ("--rampup-batch-size", lambda a: a.rampup_batch_size is not None),
    ("--decoupled-lr", lambda a: a.decoupled_lr is not None),
    ("--calculate-per-token-loss", lambda a: a.calculate_per_token_loss),
    ("--overlap-grad-reduce", lambda a: a.overlap_grad_reduce),
    ("--cross-entropy-loss-fusion", lambda a: a.cross_entropy_loss_fusion),
]


def _compose_plain(engine: Engine, model: torch.nn.Module, optimizer, lr_scheduler_fn, train_iters: int):
    args = engine.args
    if args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1:
        raise SystemExit("rapidformer: error: --tensor-model-parallel-size/--pipeline-model-parallel-size need a "
                         "megatron-core model; plain torch/Hugging Face models train data-parallel only")
    for flag, given in _MEGATRON_ONLY_FLAGS:
        if given(args):
            raise SystemExit(f"rapidformer: error: {flag} acts on megatron-core models (their DDP, optimizer and "
                             "sample-counted scheduler); drop it for plain torch/Hugging Face models")
    model.to(engine.device)
    if args.onnx_runtime_training:
        _compile(model, args.compile_backend, engine.logger)
    model = MEMORY_WRAPPERS[args.memory_optimization](model)
    parameters = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        options = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
                       weight_decay=args.weight_decay)
        # The fused kernel exists on GPUs; foreach is the fast multi-tensor path on CPUs.
        options["fused" if engine.device.type == "cuda" else "foreach"] = True
        if args.memory_optimization == "zero-1" and torch.distributed.get_world_size() > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.AdamW, **options)
        else:
            optimizer = torch.optim.AdamW(parameters, **options)
    scaler = torch.amp.GradScaler(engine.device.type, init_scale=min(args.initial_loss_scale, 2.0 ** 16)) \
        if args.fp16 else None
    wrapped = PlainOptimizer(optimizer, parameters, args.clip_grad, scaler)
    autocast = _plain_autocast_dtype(args)
    if autocast is not None:
        model.forward = torch.autocast(engine.device.type, dtype=autocast)(model.forward)
    scheduler = _user_scheduler(lr_scheduler_fn, optimizer,
                                lambda: IterationScheduler(build_scheduler(args, optimizer, train_iters)))
    return model, wrapped, scheduler


def _compose_megatron(engine: Engine, model_obj, optimizer, lr_scheduler_fn, train_iters: int):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.utils import get_model_config

    from megatron_patch.training.step import build_optimizer, wrap_model

    args = engine.args
    if args.memory_optimization in ("zero-3", "fsdp"):
        raise SystemExit(
            f"rapidformer: error: --{args.memory_optimization}-memory-optimization shards parameters of plain/HF "
            "models only; for megatron models use --zero-2-memory-optimization (distributed optimizer) with "
            "--tensor-model-parallel-size/--pipeline-model-parallel-size"
        )
    chunks = list(model_obj) if isinstance(model_obj, (list, tuple)) else [model_obj]
    config = get_model_config(chunks[0])
    # The flags decide the precision even when the user's model was configured without it.
    config.fp16, config.bf16 = args.fp16, args.bf16
    config.calculate_per_token_loss = args.calculate_per_token_loss
    config.cross_entropy_loss_fusion = args.cross_entropy_loss_fusion  # read by each forward's loss
    if args.fp8_format is not None:  # only where Transformer Engine and CUDA exist (arguments.flag_notices)
        config.fp8, config.fp8_amax_history_len = args.fp8_format, args.fp8_amax_history_len
        config.fp8_amax_compute_algo = args.fp8_amax_compute_algo
    if args.fp16 or args.bf16:
        config.pipeline_dtype = torch.float16 if args.fp16 else torch.bfloat16
    if args.onnx_runtime_training:
        for chunk in chunks:
            _compile(chunk, args.compile_backend, engine.logger)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=args.use_distributed_optimizer,
        grad_reduce_in_fp32=args.fp16 or (args.bf16 and not args.grad_reduce_in_bf16),
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
    )
    model = wrap_model(chunks, ddp_config)
    if optimizer is None:
        optimizer = build_optimizer(model, OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, fp16=args.fp16, bf16=args.bf16, params_dtype=config.params_dtype,
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            use_distributed_optimizer=args.use_distributed_optimizer,
            decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        ))
    scheduler = _user_scheduler(
        lr_scheduler_fn, optimizer, lambda: build_scheduler(args, optimizer, train_iters, unit=args.global_batch_size)
    )
    return model, optimizer, scheduler


RapidformerEngine = Engine
