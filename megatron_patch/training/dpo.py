"""Preference tuning with DPO on megatron-core GPT: pairs prepared by ``megatron-patch preprocess-data --dpo``,
the reference model's log-probabilities from one pass before training, and the loss, rewards and accuracy of
examples/gpt/dpo_gpt.py as TRL's ``DPOTrainer`` computes and names them.

Example::

    megatron-patch preprocess-data --dpo --input prefs.jsonl --output-prefix data/prefs \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf/qwen2 --workers 8
    rapidformer --user-script examples/gpt/dpo_gpt.py --dpo --data-path data/prefs_dpo_document --split 98,2,0 \\
        --load ckpt/qwen2-sft --finetune --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 ...

A sample holds whole pairs, each as its chosen then its rejected sequence, every sequence attending to itself only
(megatron-core's ``thd`` format, as SFT packs conversations: training/sft.py); packed several pairs to a sample
unless ``--no-sft-packing``. A sequence's log-probability is the sum over its completion tokens (TRL's); with the
reference's (``ReferenceLogps``, computed by the model as loaded, before any step, so no second model is held) they
give each pair's rewards ``beta * (log pi - log ref)`` and its loss: ``sigmoid`` ``-log sigmoid(r_chosen -
r_rejected)``, ``ipo`` TRL's length-normalised ``(margin - 1 / (2 beta))^2``. The loss is the mean over the global
batch's pairs (``--dpo`` turns on ``--calculate-per-token-loss``, each pair counting once). With LoRA the model as
loaded is the base (the adapters start at zero), which is TRL's reference with ``peft``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy
import torch

from megatron_patch.errors import UserError
from megatron_patch.model.forward import forward_only_step
from megatron_patch.training.sft import per_token_loss


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """The loss of a DPO run: beta, the preference loss (``sigmoid`` or ``ipo``) and the weight of the chosen
    answers' SFT term (0: none).

    Example::

        DPOSettings.of(config.data)      # from --dpo-beta, --dpo-loss-type and --dpo-sft-loss-weight
    """

    beta: float = 0.1
    loss_type: str = "sigmoid"
    sft_weight: float = 0.0

    @classmethod
    def of(cls, data) -> "DPOSettings":
        return cls(data.dpo_beta, data.dpo_loss_type, data.dpo_sft_loss_weight)


REPORTS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
_REFERENCE_FILE = "dpo_reference.npz"


def sequence_logps(token_losses: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's log-probability of its trained tokens (the sum; the model's per-token loss is their negative
    log-probability) and how many they are, for the sequences a sample's ``cu_seqlens`` bound.

    Example::

        logps, counts = sequence_logps(token_losses, batch["loss_mask"], batch["cu_seqlens"])
    """
    bounds = cu_seqlens.reshape(-1).to(token_losses.device)
    owner = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=bounds.device), bounds[1:] - bounds[:-1])
    mask = loss_mask.reshape(-1).float()
    zeros = torch.zeros(len(bounds) - 1, device=token_losses.device)
    logps = zeros.index_add(0, owner, -token_losses.reshape(-1).float() * mask)
    return logps, zeros.index_add(0, owner, mask)


def dpo_loss(batch: dict, token_losses: torch.Tensor, reference: torch.Tensor, settings: DPOSettings):
    """The three-value loss of one sample's pairs (``batch["items"]``, ``reference[item]`` their reference
    log-probabilities, chosen then rejected): the sum of the pairs' losses, their count, and the reports TRL logs
    (each a sum with the count, megatron-core's reduction averaging them over the global batch).

    A pair's loss is its preference loss plus ``settings.sft_weight`` times its chosen answer's negative
    log-likelihood per token: TRL's ``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, w]`` at one pair per
    micro-batch, NeMo-RL's ``sft_loss_weight`` with ``sft_average_log_probs``."""
    items = batch["items"].reshape(-1)
    pairs = len(items)
    logps, counts = sequence_logps(token_losses, batch["loss_mask"], batch["cu_seqlens"])
    ref = reference[items.cpu()].to(logps.device) if pairs else torch.zeros(0, 2, device=logps.device)
    beta = settings.beta
    chosen_logps, chosen_tokens = logps[0:2 * pairs:2], counts[0:2 * pairs:2].clamp(min=1.0)
    chosen = chosen_logps - ref[:, 0]
    rejected = logps[1:2 * pairs:2] - ref[:, 1]
    if settings.loss_type == "sigmoid":
        losses = -torch.nn.functional.logsigmoid(beta * (chosen - rejected))
    else:  # TRL's ipo: the log-ratios per completion token
        margin = chosen / chosen_tokens - rejected / counts[1:2 * pairs:2].clamp(min=1.0)
        losses = (margin - 1 / (2 * beta)) ** 2
    if settings.sft_weight:
        losses = losses - settings.sft_weight * chosen_logps / chosen_tokens
    # A sample of no pairs (the padding of a dev set) still gives a loss joined to the model's output.
    loss = losses.sum() if pairs else token_losses.sum() * 0.0
    count = torch.tensor(float(pairs), device=logps.device)
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    values = (chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).float().sum(),
              (chosen_rewards - rejected_rewards).sum())
    reports = {"lm loss": torch.stack([loss.detach(), count])}
    reports.update({name: torch.stack([value, count]) for name, value in zip(REPORTS, values)})
    return loss, count.to(torch.int), reports


def dpo_forward_step(batch: dict, model, reference: torch.Tensor, settings: DPOSettings):
    """The forward step of a DPO sample: the model's per-token loss of every sequence, then ``dpo_loss``."""
    return per_token_loss(batch, model), lambda output: dpo_loss(batch, output, reference, settings)


def _logps_report(batch: dict, output: torch.Tensor):
    """The reference pass's loss function: no loss, each pair's item and sequence log-probabilities."""
    items = batch["items"].reshape(-1)
    logps, _ = sequence_logps(output, batch["loss_mask"], batch["cu_seqlens"])
    return output.sum() * 0.0, torch.tensor(1), {"items": items.cpu(), "logps": logps[:2 * len(items)].cpu()}


def _identity(dataset) -> str:
    """What a reference table was computed for: the data's files, the items taken and their order in samples."""
    parts = [(os.path.abspath(p.prefix), os.path.getsize(p.prefix + ".bin")) for p in dataset.parts]
    samples = hashlib.sha256(numpy.concatenate(dataset.samples or [numpy.zeros(0, numpy.int64)]).tobytes())
    return hashlib.sha256(json.dumps([parts, dataset.items.tolist(), samples.hexdigest()]).encode()).hexdigest()


def compute_reference(chunks: list, dataset, seq_length: int) -> numpy.ndarray | None:
    """``[items, 2]``: each pair's chosen and rejected log-probabilities under the model as it is (the reference),
    from a forward pass over ``dataset``'s samples split over the data-parallel ranks; None off the last pipeline
    stage, which alone computes losses."""
    from megatron.core import parallel_state

    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = range(rank, len(dataset), size)
    table = numpy.full((len(dataset.items), 2), numpy.nan)
    for chunk in chunks:
        chunk.eval()
    if len(mine):
        iterators = [iter(dataset[i] for i in mine) for _ in chunks]
        reports = forward_only_step(
            chunks, iterators if len(chunks) > 1 else iterators[0],
            lambda it, model: _reference_step(next(it), model), len(mine), seq_length, 1)
    else:
        reports = []
    for chunk in chunks:
        chunk.train()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    gathered: list = [None] * size
    torch.distributed.all_gather_object(gathered, [(r["items"].numpy(), r["logps"].numpy()) for r in reports],
                                        group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    for items, logps in (pair for rank_reports in gathered for pair in rank_reports):
        table[items] = logps.reshape(-1, 2)
    return table


def _reference_step(sample: dict, model):
    batch = {key: value.unsqueeze(0) if key not in ("cu_seqlens", "items") else value
             for key, value in sample.items()}
    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in batch.items()}
    return per_token_loss(batch, model), lambda output: _logps_report(batch, output)


class ReferenceLogps:
    """The reference log-probabilities of a run's train and dev pairs: computed once, before the first step, and
    saved in ``--save`` (``dpo_reference.npz``, with what they were computed for); a resumed run reads them from its
    ``--load`` instead of computing them from a model that has trained since.

    Example::

        reference = ReferenceLogps.for_run(trainer, train, dev)   # in the trainer's after_load
        reference.train[item]                                     # tensor([chosen, rejected])
    """

    def __init__(self, train: numpy.ndarray | None, dev: numpy.ndarray | None, source: str | None):
        self.train = None if train is None else torch.from_numpy(train)
        self.dev = None if dev is None else torch.from_numpy(dev)
        self.source = source
        """The file the log-probabilities were read from; None where this run computed them."""

    @classmethod
    def for_run(cls, trainer, train, dev, log=print) -> "ReferenceLogps":
        from megatron.core import parallel_state

        checkpoints = trainer.config.checkpointing
        identity = numpy.array([_identity(train), _identity(dev) if dev is not None else ""])
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        source = None
        if trainer.iteration:  # resumed: the model has trained, its reference is the one saved at the start
            source = os.path.join(checkpoints.load, _REFERENCE_FILE)
            if not last:
                return cls(None, None, source)
            try:
                with numpy.load(source) as stored:
                    if stored["identity"].tolist() != identity.tolist():
                        raise UserError(f"{source} holds the reference log-probabilities of other data than this "
                                        "run's (another --data-path, --split, --seq-length or packing): resume with "
                                        "the flags the run started with")
                    tables = [stored["train"], stored["dev"] if dev is not None else None]
            except FileNotFoundError:
                raise UserError(f"--load {checkpoints.load} is at iteration {trainer.iteration} but has no "
                                f"{_REFERENCE_FILE}: a DPO run resumes from the --save of a DPO run; to start one "
                                "from this checkpoint, give --finetune") from None
        else:
            log(f" DPO reference: log-probabilities of {len(train.items)} train pairs"
                + (f" and {len(dev.items)} dev pairs" if dev is not None else "") + " under the model as loaded")
            tables = [compute_reference(trainer._chunks(), dataset, trainer.config.data.seq_length)
                      if dataset is not None else None for dataset in (train, dev)]
        # Beside this run's checkpoints (a resume into another --save too), so that its own resumes find them.
        if last and checkpoints.save and parallel_state.get_data_parallel_rank() == 0 \
                and parallel_state.get_tensor_model_parallel_rank() == 0 \
                and os.path.join(checkpoints.save, _REFERENCE_FILE) != source:
            os.makedirs(checkpoints.save, exist_ok=True)
            final = os.path.join(checkpoints.save, _REFERENCE_FILE)
            temporary = f"{final}.tmp-{os.getpid()}.npz"
            numpy.savez(temporary, train=tables[0], dev=tables[1] if tables[1] is not None else numpy.zeros((0, 2)),
                        identity=identity)
            os.replace(temporary, final)
        return cls(*tables, source)


def dpo_metrics(chunks: list, loader, seq_length: int, reference: torch.Tensor, settings: DPOSettings
                ) -> dict[str, float]:
    """The dev set's DPO loss, rewards, accuracy and margin (means over its pairs, all data-parallel ranks; the
    loader's batches whole, as the dev set is padded); ``{}`` off the last pipeline stage."""
    from megatron.core import parallel_state

    iterators = [iter(loader) for _ in chunks]
    reports = forward_only_step(chunks, iterators if len(chunks) > 1 else iterators[0],
                                lambda it, model: dpo_forward_step(next(it), model, reference, settings),
                                len(loader), seq_length, 1)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    names = ["lm loss", *REPORTS]
    totals = torch.stack([torch.stack([r[name].float() for r in reports]).sum(dim=0) for name in names])
    torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    values = (totals[:, 0] / totals[:, 1].clamp(min=1.0)).tolist()
    return {"loss" if name == "lm loss" else name: value for name, value in zip(names, values)}
