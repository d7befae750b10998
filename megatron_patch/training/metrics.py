"""Training logs in Megatron-LM's line format, TensorBoard scalars, and a loss-curve PNG at the end.

Example::

    log = TrainingLog(logger, log_interval=10, flops_per_sample=6.3e9, tensorboard_dir=None, world_size=8)
    log.step(iteration=10, consumed_samples=80, lr=1e-4, loss=3.2, grad_norm=1.1, loss_scale=65536.0,
             skipped=False, step_time=0.12, tokens=4096, samples=8)
    log.validation(iteration=10, loss=3.3)
    log.plot("logs/loss_curves.png")
    log.close()

With ``record_path`` every iteration is also appended to a JSON-lines file at full precision (``iteration``,
``consumed_samples``, ``lr``, ``loss``, ``grad_norm``, ``loss_scale``, ``skipped``, ``global_batch_size`` and
any other reported loss such as ``sop loss``), flushed as it is written, so a run killed at any point leaves the
record of what it did (a resumed run appends the iterations it repeats).

A line reads like Megatron-LM's: `` iteration 10/100 | consumed samples: 80 | elapsed time per iteration (ms):
120.0 | learning rate: 1.000E-04 | global batch size: 8 | lm loss: 3.200E+00 | loss scale: 65536.0 | grad norm:
1.100 | number of skipped iterations: 0 | tokens/s: 34133 | peak memory (MB): 512``; TFLOP/s and MFU are added on GPUs:
TFLOP/s per GPU = ``flops_per_sample`` x samples / step time / ``world_size`` / 1e12, MFU = that / the GPU's peak.
The trainers give ``tensorboard_dir`` and ``wandb_options`` (``wandb.init``'s arguments: W&B gets the same scalars, as
Megatron-LM's ``--wandb-project``) to the last rank only (it holds the loss under pipeline parallelism).

The loss is named by what it is: ``lm loss`` for a language model's, ``classification loss`` for a sequence
classifier's (``loss_name``, from the training backend that knows the model). Megatron-LM's tasks/finetune_utils.py
(core_v0.16.1) logs its classifiers' cross-entropy as 'lm loss' too; a classifier has no language-model loss, so
here the name says what was measured.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource

import torch

LM_LOSS = "lm loss"
CLASSIFICATION_LOSS = "classification loss"

# Dense bf16/fp16 peak of the GPUs we quote MFU against (docs/flops-and-mfu.md, item 2).
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def _peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in _PEAK_TFLOPS.items() if key in name), None)


def peak_memory_mb() -> float:
    """Peak GPU memory allocated on GPUs; peak resident set size of this process on CPUs."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class TrainingLog:
    """Accumulates per-iteration numbers, prints every ``log_interval`` and keeps the curves."""

    def __init__(self, logger: logging.Logger, log_interval: int, train_iters: int | None = None,
                 flops_per_sample: float | None = None, tensorboard_dir: str | None = None,
                 record_path: str | None = None, world_size: int = 1, loss_name: str = LM_LOSS,
                 wandb_options: dict | None = None):
        self.logger = logger
        self.loss_name = loss_name
        self.log_interval = max(1, log_interval)
        self.train_iters = train_iters
        self.flops_per_sample = flops_per_sample
        self.world_size = world_size
        self.peak_tflops = _peak_tflops()
        self.train_losses: list[tuple[int, float]] = []
        self.valid_losses: list[tuple[int, float]] = []
        self.step_times: list[float] = []  # seconds per iteration, as logged
        self.skipped = 0
        self._window: list[dict] = []
        self.record = None
        if record_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(record_path)), exist_ok=True)
            self.record = open(record_path, "a", encoding="utf-8")
            if self.record.tell():  # a killed run may have left half a line: end it, so this run's lines parse
                with open(record_path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        self.record.write("\n")
        self.writer = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)
        self.wandb_run = None
        if wandb_options:
            import wandb

            os.makedirs(wandb_options["dir"], exist_ok=True)
            self.wandb_run = wandb.init(**wandb_options)

    def scalar(self, name: str, value: float, iteration: int) -> None:
        """``value`` under ``name`` in TensorBoard and W&B (nothing without ``--tensorboard-dir``/``--wandb-project``
        or for None); ``RoutingLog`` writes its per-layer losses through it too.

        Example::

            log.scalar("moe/load_balancing_loss_layer_0", 1.01, iteration=10)
        """
        if self.writer is not None and value is not None:
            self.writer.add_scalar(name, value, iteration)
        if self.wandb_run is not None and value is not None:
            # Megatron-LM's training_log: wandb_writer.log({name: value}, iteration), scalar by scalar.
            self.wandb_run.log({name: value}, step=iteration)

    def step(self, iteration: int, consumed_samples: int, lr: float, loss: float | None, grad_norm: float | None,
             loss_scale: float, skipped: bool, step_time: float, tokens: int, samples: int,
             other_losses: dict[str, float] | None = None) -> None:
        """Record one iteration; ``other_losses`` are losses reported beside the loss (BERT's "sop loss" beside
        its "lm loss"), logged after it under their names as Megatron-LM does."""
        other_losses = other_losses or {}
        self.skipped += int(skipped)
        self.step_times.append(step_time)
        if loss is not None:
            self.train_losses.append((iteration, loss))
        self._window.append(dict(loss=loss, grad_norm=grad_norm, step_time=step_time, tokens=tokens,
                                 samples=samples, other_losses=other_losses))
        if self.record is not None:
            self.record.write(json.dumps(dict(iteration=iteration, consumed_samples=consumed_samples, lr=lr, loss=loss,
                                              grad_norm=grad_norm, loss_scale=loss_scale, skipped=skipped,
                                              global_batch_size=samples, **other_losses)) + "\n")
            self.record.flush()
        for name, value in ((self.loss_name, loss), ("learning-rate", lr), ("grad-norm", grad_norm),
                            ("loss-scale", loss_scale), *other_losses.items()):
            self.scalar(name, value, iteration)
        if iteration % self.log_interval and iteration != self.train_iters:
            return
        window, self._window = self._window, []
        seconds = sum(w["step_time"] for w in window) / len(window)
        losses = [w["loss"] for w in window if w["loss"] is not None]
        tokens_per_s = sum(w["tokens"] for w in window) / max(sum(w["step_time"] for w in window), 1e-9)
        total = f"/{self.train_iters}" if self.train_iters else ""
        parts = [
            f" iteration {iteration}{total}",
            f"consumed samples: {consumed_samples}",
            f"elapsed time per iteration (ms): {seconds * 1000:.1f}",
            f"learning rate: {lr:.3E}",
            f"global batch size: {window[-1]['samples']}",
        ]
        if losses:
            parts.append(f"{self.loss_name}: {sum(losses) / len(losses):.6E}")
        for name in other_losses:
            values = [w["other_losses"][name] for w in window if name in w["other_losses"]]
            parts.append(f"{name}: {sum(values) / len(values):.6E}")
        parts += [f"loss scale: {loss_scale:.1f}"]
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        parts += [f"number of skipped iterations: {self.skipped}", f"tokens/s: {tokens_per_s:.0f}"]
        if self.flops_per_sample and self.peak_tflops:
            samples_per_s = sum(w["samples"] for w in window) / max(sum(w["step_time"] for w in window), 1e-9)
            tflops = samples_per_s * self.flops_per_sample / self.world_size / 1e12
            parts += [f"TFLOP/s/GPU: {tflops:.1f}", f"MFU: {100 * tflops / self.peak_tflops:.1f}%"]
            self.scalar("tflops-per-gpu", tflops, iteration)
        parts.append(f"peak memory (MB): {peak_memory_mb():.0f}")
        self.scalar("tokens-per-second", tokens_per_s, iteration)
        self.logger.info(" | ".join(parts))

    def validation(self, iteration: int, loss: float) -> None:
        self.valid_losses.append((iteration, loss))
        perplexity = math.exp(min(loss, 20.0))
        self.scalar(f"validation {self.loss_name}", loss, iteration)
        self.scalar("validation ppl", perplexity, iteration)
        self.logger.info(f" validation loss at iteration {iteration} | {self.loss_name}: {loss:.6E} | "
                         f"{self.loss_name} PPL: {perplexity:.6E}")

    def evaluation(self, iteration: int, values: dict) -> None:
        """A fine-tuner's metrics at ``--eval-interval``: its loss as Megatron-LM's validation line, the others
        beside it."""
        if "loss" in values:
            self.validation(iteration, values["loss"])
        others = {name: value for name, value in values.items() if name not in ("loss", "ppl")}
        for name, value in others.items():
            self.scalar(f"validation {name}", value, iteration)
        if others:
            self.logger.info(f" validation at iteration {iteration} | "
                             + " | ".join(f"{k}: {v:.4f}" for k, v in others.items()))

    def metrics(self, epoch: int, values: dict) -> None:
        for name, value in values.items():
            self.scalar(f"eval {name}", value, epoch)
        self.logger.info(f" epoch {epoch} | " + " | ".join(f"{k}: {v:.4f}" for k, v in values.items()))

    def close(self) -> None:
        """Write out and close the TensorBoard events, the W&B run and the record."""
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.record is not None:
            self.record.close()

    def plot(self, path: str) -> str | None:
        """Write the training (and validation) loss curves; returns the path, or None with nothing to plot."""
        if self.writer is not None:
            self.writer.flush()
        if not self.train_losses:
            return None
        import matplotlib

        matplotlib.use("Agg")  # no display on training nodes
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4))
        axes.plot(*zip(*self.train_losses), label="train")
        if self.valid_losses:
            axes.plot(*zip(*self.valid_losses), "o-", label="validation")
        axes.set_xlabel("iteration")
        axes.set_ylabel(self.loss_name)
        axes.legend()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        figure.savefig(path, dpi=100)
        plt.close(figure)
        self.logger.info(f"loss curves: {path}")
        return path


class RoutingLog:
    """The routing statistics of a mixture-of-experts model beside a ``TrainingLog``: per MoE layer, its
    auxiliary losses and the tokens per expert, averaged over each log interval and printed after the iteration
    line (which carries Megatron-LM's ``load_balancing_loss``, the mean over the MoE layers, as one of the step's
    other losses); TensorBoard gets each layer's losses every iteration under Megatron-LM's names
    (``moe/load_balancing_loss_layer_{i}``, i from 0, as megatron-core's ``track_moe_metrics`` writes them).

    Example::

        routing = RoutingLog(log)
        routing.step(10, stats.routing)     # a training/step.py RoutingStep, or None for a dense model
        # [rapidformer]  routing of layer 1 at iteration 10 | load_balancing_loss: 1.012000E+00 | tokens per
        #   expert per iteration: 130 120 126 136        (each layer's sum: the global batch's tokens x top-k)
    """

    def __init__(self, log: TrainingLog):
        self.log = log
        self._window: list = []

    def step(self, iteration: int, routing) -> None:
        if routing is None:
            return
        self._window.append(routing)
        for name, per_layer in routing.aux_losses.items():
            for layer, loss in per_layer.items():
                self.log.scalar(f"moe/{name}_layer_{layer - 1}", loss, iteration)
        if iteration % self.log.log_interval and iteration != self.log.train_iters:
            return
        window, self._window = self._window, []
        for layer in window[-1].tokens_per_expert:
            parts = [f" routing of layer {layer} at iteration {iteration}"]
            for name in window[-1].aux_losses:
                losses = [w.aux_losses[name][layer] for w in window if layer in w.aux_losses.get(name, {})]
                parts.append(f"{name}: {sum(losses) / len(losses):.6E}")
            counts = [w.tokens_per_expert[layer] for w in window if layer in w.tokens_per_expert]
            means = [sum(column) / len(counts) for column in zip(*counts)]
            parts.append("tokens per expert per iteration: " + " ".join(f"{mean:g}" for mean in means))
            self.log.logger.info(" | ".join(parts))
