"""The ``--dry-run`` plan of a launch: world size, process layout, batch arithmetic and the memory of weights,
gradients and optimizer state per GPU, from the flags ``rapidformer`` takes. Nothing is started.

Example::

    NNODES=2 python -m megatron_patch.training.plan --model-name llama2-7b --nproc-per-node 8 --bf16 \
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --use-distributed-optimizer \
        --micro-batch-size 1 --global-batch-size 256
    python -m megatron_patch.training.plan --print-train-iters --train-tokens 1000000000 --model-name gpt2-124m \
        --global-batch-size 512                            # prints 1908: ceil(1e9 / (512 x 1024 tokens))

The run_scripts/ recipes call this for ``--dry-run`` and to turn ``--train-tokens`` into iterations. The world is
``NNODES`` (``--nnodes``) x ``--nproc-per-node`` processes, the ranks are grouped by megatron-core's own
``RankGenerator`` in its default order, and the memory follows Megatron-LM's accounting in
``megatron/training/theoretical_memory_usage.py`` (``compute_weight_and_optimizer_memory``): the most loaded
pipeline stage's parameters divided by TP, times bytes per parameter. Activations are left out (they depend on
the schedule, recompute and sequence parallelism; the same file's ``compute_activation_memory`` estimates them).

A mixture-of-experts model's routed experts live on megatron-core's second grid: each rank holds experts / EP of
every MoE layer, each split over the expert TP, and the distributed optimizer shards their state over the
expert-data-parallel ranks (world / (expert TP x EP x PP)) instead of the data-parallel ones; the plan lists the
expert-parallel and expert-data-parallel groups and counts the experts' memory that way.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

from megatron_patch.errors import FlagParser
from megatron_patch.model import ModelConfig, num_parameters
from megatron_patch.model.flops import expert_parameters, layer_parameters, mtp_parameters
from megatron_patch.model.lora import LoraSettings
from megatron_patch.tokenizer.registry import build_tokenizer
from megatron_patch.training.arguments import parse_flags, run_config
from megatron_patch.training.launcher import processes_per_node

GIB = 2 ** 30
# megatron-core's default order of the process grid (parallel_state.initialize_model_parallel's `order`), which
# megatron_patch.distributed.initialize_distributed keeps: TP ranks are adjacent (one node), PP the outermost.
RANK_ORDER = "tp-cp-ep-dp-pp"


@dataclasses.dataclass
class Stage:
    """One pipeline stage: its ranks, its layers and what it holds besides them."""

    ranks: list[int]
    layers: list[int]
    extras: list[str]
    parameters: int
    """All parameters of the stage (every TP shard together)."""
    expert_parameters: int = 0
    """The routed experts among them (every EP and expert-TP shard together)."""


@dataclasses.dataclass
class Plan:
    model_name: str
    model: ModelConfig
    padded_vocab: int
    nnodes: int
    nproc_per_node: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    sequence_parallel: bool
    recompute: str
    micro_batch_size: int
    global_batch_size: int
    train_iters: int | None
    precision: str
    distributed_optimizer: bool
    stages: list[Stage]
    tp_groups: list[list[int]]
    dp_groups: list[list[int]]
    ep: int = 1
    etp: int = 1
    ep_groups: list[list[int]] = dataclasses.field(default_factory=list)
    expert_dp_groups: list[list[int]] = dataclasses.field(default_factory=list)
    lora: "LoraSettings | None" = None
    """``--lora-rank``'s adapters: the base frozen, only they have gradients and optimizer state."""

    @property
    def expert_dp(self) -> int:
        """The experts' data-parallel size: world / (expert TP x EP x PP)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def total_parameters(self) -> int:
        return num_parameters(self.model, self.padded_vocab)

    def _per_gpu(self, stage: Stage) -> tuple[float, float]:
        """(other parameters, routed experts) of one GPU of ``stage``: as Megatron-LM, the stage's parameters / TP
        (norms, replicated over TP, are a rounding error here); the experts / (expert TP x EP)."""
        return (stage.parameters - stage.expert_parameters) / self.tp, stage.expert_parameters / (self.etp * self.ep)

    @property
    def most_loaded_stage(self) -> int:
        return max(range(self.pp), key=lambda s: sum(self._per_gpu(self.stages[s])))

    @property
    def parameters_per_gpu(self) -> float:
        return sum(self._per_gpu(self.stages[self.most_loaded_stage]))

    @property
    def expert_parameters_per_gpu(self) -> float:
        return self._per_gpu(self.stages[self.most_loaded_stage])[1]

    def bytes_per_parameter(self, data_parallel_size: int | None = None) -> dict[str, float]:
        """Weights, gradients and optimizer state in bytes per parameter, as Megatron-LM counts them, the
        optimizer's sharded over ``data_parallel_size`` (default DP; the routed experts': the expert DP).

        Mixed precision with Adam: 2 (bf16/fp16 weights) + 4 (fp32 gradients: the engine reduces gradients in
        fp32) + 12 (fp32 master weights, Adam's two moments) = 18; the distributed optimizer shards the 12 over
        DP: 6 + 12/DP (theoretical_memory_usage.py, ``num_bytes_per_parameter``). In fp32 the weights are the
        master copy: 4 + 4 + 8 = 16, or 8 + 8/DP.
        """
        mixed = self.precision in ("bf16", "fp16")
        optimizer = 12 if mixed else 8
        shards = data_parallel_size or self.dp
        return {"weights": 2 if mixed else 4, "gradients": 4,
                "optimizer": optimizer / shards if self.distributed_optimizer else optimizer}

    def memory_gib(self) -> dict[str, float]:
        others, experts = self._per_gpu(self.stages[self.most_loaded_stage])
        expert_bytes = self.bytes_per_parameter(self.expert_dp)
        full = {name: (others * size + experts * expert_bytes[name]) / GIB
                for name, size in self.bytes_per_parameter().items()}
        if self.lora is None:
            return full
        # The frozen base keeps its weights only; the adapters are trained as any parameter is.
        adapters = self.lora_parameters_per_gpu
        return {name: (full["weights"] if name == "weights" else 0.0) + adapters * size / GIB
                for name, size in self.bytes_per_parameter().items()}

    def lora_layer_parameters(self, tp: int = 1) -> float:
        """Adapter parameters of one transformer layer on one GPU at tensor parallelism ``tp``: per adapted linear
        ``rank x (in + out)``, the split side divided by TP (column-parallel layers split B, row-parallel ones A;
        model/lora.py). A mixture of experts' MLPs are not adapted."""
        m, r = self.model, self.lora.rank
        d = m.kv_channels or m.hidden_size // m.num_attention_heads
        ffn_out = m.ffn_hidden_size * (2 if m.gated_mlp else 1)
        # layer -> (replicated, split) parameters of its adapter
        shapes = {"linear_qkv": (m.hidden_size, (m.num_attention_heads + 2 * m.num_query_groups) * d),
                  "linear_proj": (m.hidden_size, m.num_attention_heads * d),
                  "linear_fc1": (m.hidden_size, ffn_out), "linear_fc2": (m.hidden_size, m.ffn_hidden_size)}
        if m.num_moe_experts:
            shapes = {k: v for k, v in shapes.items() if k in ("linear_qkv", "linear_proj")}
        return sum(r * (replicated + split / tp) for name, (replicated, split) in shapes.items()
                   if name in self.lora.targets)

    @property
    def lora_parameters(self) -> int:
        return round(self.lora_layer_parameters() * self.model.num_layers)

    @property
    def lora_parameters_per_gpu(self) -> int:
        return round(self.lora_layer_parameters(self.tp) * len(self.stages[self.most_loaded_stage].layers))

    def render(self) -> str:
        m, node = self.model, lambda rank: rank // self.nproc_per_node
        seq = m.seq_length
        groups = m.num_query_groups
        lines = [
            "dry run: the plan of this launch; nothing is started",
            f"model: {self.model_name} ({m.family}): {m.num_layers} layers, hidden {m.hidden_size}, ffn "
            f"{m.ffn_hidden_size}, {m.num_attention_heads} heads ({groups} query groups), seq {seq}, vocab "
            f"{m.vocab_size} padded to {self.padded_vocab}"
            f"{', untied output layer' if m.untie_embeddings_and_output_weights else ', tied output layer'}",
            f"world size: {self.world_size} = {self.nnodes} node{'s' if self.nnodes > 1 else ''} (NNODES) x "
            f"{self.nproc_per_node} processes (--nproc-per-node)",
            f"layout: TP {self.tp} x CP {self.cp} x DP {self.dp} x PP {self.pp} (VPP {self.vpp}, sequence parallel "
            f"{'on' if self.sequence_parallel else 'off'}, recompute {self.recompute}); ranks in megatron-core's "
            f"order {RANK_ORDER}",
        ]
        for index, stage in enumerate(self.stages):
            nodes = sorted({node(r) for r in stage.ranks})
            lines.append(
                f"pipeline stage {index}: ranks {_spans(stage.ranks)} (node {_spans(nodes)}), layers "
                f"{_spans(stage.layers)}{''.join(' + ' + e for e in stage.extras)}: {stage.parameters:,} parameters")
        groups = [("tensor", self.tp_groups), ("data", self.dp_groups)]
        if m.num_moe_experts:
            lines.append(
                f"experts: {m.num_moe_experts} per MoE layer, top-{m.moe_router_topk}; {m.num_moe_experts // self.ep} "
                f"per rank (EP {self.ep}, expert TP {self.etp}, expert DP {self.expert_dp} = {self.world_size} / "
                f"({self.etp} x {self.ep} x PP {self.pp}))")
            groups += [("expert", self.ep_groups), ("expert-data", self.expert_dp_groups)]
        for name, found in groups:
            shown = " ".join(str(g) for g in found[:4]) + (f" ... ({len(found)} groups)" if len(found) > 4 else "")
            lines.append(f"{name}-parallel groups: {shown}")
        if any(len({node(r) for r in group}) > 1 for group in self.tp_groups):
            lines.append("warning: tensor-parallel groups span nodes (TP all-reduces every layer); use "
                         "--tensor-model-parallel-size <= --nproc-per-node")
        gbs, accumulation = self.global_batch_size, self.gradient_accumulation_steps
        lines += [
            f"micro batch per GPU: {self.micro_batch_size} sequences ({self.micro_batch_size * seq:,} tokens)",
            f"global batch: {gbs} sequences ({gbs * seq:,} tokens)",
            f"gradient accumulation steps: {accumulation} = {gbs} / ({self.micro_batch_size} micro x "
            f"{self.dp} DP)",
        ]
        if self.train_iters:
            lines.append(f"train iterations: {self.train_iters} ({self.train_iters * gbs * seq:,} tokens)")
        size, memory = self.bytes_per_parameter(), self.memory_gib()
        optimizer = (f"{size['optimizer']:g} (fp32 master weights and Adam moments / DP {self.dp}, distributed "
                     "optimizer)" if self.distributed_optimizer else f"{size['optimizer']:g} (Adam, not sharded)")
        per_gpu = f"(pipeline stage {self.most_loaded_stage} / TP {self.tp})"
        if m.num_moe_experts:
            per_gpu = (f"(pipeline stage {self.most_loaded_stage}: others / TP {self.tp}, routed experts / (expert TP "
                       f"{self.etp} x EP {self.ep}) = {round(self.expert_parameters_per_gpu):,})")
        lines += [
            f"parameters: {self.total_parameters:,} total"
            + (f", {num_parameters(m, self.padded_vocab, active=True):,} active per token" if m.num_moe_experts
               else ""),
            f"parameters per GPU: {round(self.parameters_per_gpu):,} {per_gpu}",
            f"bytes per parameter: {sum(size.values()):g} = weights {size['weights']:g} ({self.precision}) + "
            f"gradients {size['gradients']:g} (fp32) + optimizer {optimizer}",
        ]
        if m.num_moe_experts and self.distributed_optimizer:
            lines.append(f"routed experts: optimizer {self.bytes_per_parameter(self.expert_dp)['optimizer']:g} "
                         f"bytes per parameter (sharded over expert DP {self.expert_dp})")
        if self.lora is not None:
            adapters = self.lora_parameters
            saved = sum(self.full_memory_gib().values()) - sum(memory.values())
            lines += [
                f"LoRA: rank {self.lora.rank}, alpha {self.lora.alpha:g} on {','.join(self.lora.targets)}: "
                f"{adapters:,} trainable parameters ({100 * adapters / self.total_parameters:.2f}% of the model), "
                f"{self.lora_parameters_per_gpu:,} per GPU; the base is frozen (weights only, no gradients or "
                "optimizer state)",
                f"LoRA saves {saved:.2f} GiB per GPU against full fine-tuning "
                f"({sum(self.full_memory_gib().values()):.2f} GiB)",
            ]
        # A CPU run (the recipes' --cpu hides every GPU) has processes, and a tiny model's MiB showed as "0.00 GiB".
        where = "process" if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else "GPU"
        unit, scale = ("GiB", 1) if sum(memory.values()) >= 0.1 else ("MiB", 1024)
        lines += [
            f"memory per {where}: {scale * sum(memory.values()):.2f} {unit} = weights {scale * memory['weights']:.2f} "
            f"+ gradients {scale * memory['gradients']:.2f} + optimizer {scale * memory['optimizer']:.2f} {unit}; "
            f"activations, buffers{' and the CUDA context' if where == 'GPU' else ''} not included",
        ]
        return "\n".join(lines)

    def full_memory_gib(self) -> dict[str, float]:
        """``memory_gib`` of the same run without LoRA (every weight trained)."""
        return dataclasses.replace(self, lora=None).memory_gib()


def _spans(values: list[int]) -> str:
    """``[0, 1, 2, 5, 8, 9]`` -> ``"0-2, 5, 8-9"``."""
    spans: list[list[int]] = []
    for value in values:
        if spans and value == spans[-1][1] + 1:
            spans[-1][1] = value
        else:
            spans.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _stages(model: ModelConfig, vocab: int, pp: int, vpp: int, stage_ranks: list[list[int]]) -> list[Stage]:
    """What each pipeline rank holds: its VPP chunks of layers, the input embedding on the first, the final norm,
    heads and output layer on the last. With tied embeddings and PP > 1 the last stage keeps its own copy of the
    word embeddings as the output layer (megatron-core's ``setup_embeddings_and_output_layer``)."""
    m, h = model, model.hidden_size
    embedding = vocab * h + m.num_tokentypes * h + (m.max_positions * h if m.position_embedding_type ==
                                                    "learned_absolute" else 0)
    output = vocab * h if m.untie_embeddings_and_output_weights or pp > 1 else 0
    # Final norm (and BERT's LM and binary heads): what the whole model has beyond layers, embedding and output.
    mtp = m.mtp_num_layers or 0  # megatron-core builds multi-token prediction on the last stage
    head = num_parameters(m, vocab) - sum(layer_parameters(m, i) for i in range(m.num_layers)) - embedding - (
        vocab * h if m.untie_embeddings_and_output_weights else 0) - mtp * mtp_parameters(m)
    chunk = m.num_layers // (pp * vpp)
    stages = []
    for s in range(pp):
        layers = [c * chunk + i for c in range(s, pp * vpp, pp) for i in range(chunk)]
        extras, parameters = [], sum(layer_parameters(m, i) for i in layers)
        experts = sum(expert_parameters(m, i) for i in layers)
        if s == 0:
            extras.append("embedding")
            parameters += embedding
        if s == pp - 1:
            extras.append("final norm" if m.family == "gpt" else "LM head")
            parameters += head
            if output:
                extras.append("output layer" if m.untie_embeddings_and_output_weights else
                              "output layer (a copy of the tied embedding)")
                parameters += output
            if mtp:
                extras.append(f"{mtp} multi-token prediction module(s)")
                parameters += mtp * mtp_parameters(m)
                experts += mtp * expert_parameters(m, m.num_layers - 1)
        stages.append(Stage(ranks=sorted(stage_ranks[s]), layers=layers, extras=extras, parameters=parameters,
                            expert_parameters=experts))
    return stages


def build_plan(argv: list[str], nnodes: int = 1, train_tokens: int | None = None) -> Plan:
    """The plan of ``rapidformer argv`` on ``nnodes`` nodes; ValueError/SystemExit name the flag at fault.

    Example::

        plan = build_plan(["--model-name", "gpt2-124m", "--nproc-per-node", "8", "--global-batch-size", "64"])
        plan.gradient_accumulation_steps, plan.memory_gib()      # 8, {'weights': ..., ...}
    """
    from megatron.core.parallel_state import RankGenerator

    flags = parse_flags(argv)
    nproc = processes_per_node(flags.nproc_per_node)
    if nnodes < 1:
        raise ValueError(f"NNODES (--nnodes) must be at least 1, got {nnodes}")
    # The checks of the launcher but what this machine lacks (Transformer Engine for CP): a plan is for the cluster.
    config = run_config(flags, nnodes * nproc, this_machine=False)
    parallel, training = config.parallel, config.training
    vocab_size = None
    if config.tokenizer_type:
        vocab_size = build_tokenizer(config.tokenizer_type, **dict(config.tokenizer_options)).vocab_size
    model, vocab = config.model.model_and_vocab(config.model.family or "gpt", vocab_size,
                                                parallel.tensor_model_parallel_size)
    vpp = parallel.virtual_pipeline_model_parallel_size or 1
    dp, gbs = training.data_parallel_size, training.global_batch_size
    if train_tokens is not None and training.train_iters is not None:
        raise ValueError("give --train-iters or --train-tokens, not both")
    train_iters = math.ceil(train_tokens / (gbs * model.seq_length)) if train_tokens is not None else \
        training.train_iters
    ranks = RankGenerator(tp=parallel.tensor_model_parallel_size, ep=1, dp=dp,
                          pp=parallel.pipeline_model_parallel_size, cp=parallel.context_parallel_size,
                          order=RANK_ORDER)
    pp = parallel.pipeline_model_parallel_size
    ep = parallel.expert_model_parallel_size
    etp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    # megatron-core's second grid for the expert layers (parallel_state.initialize_model_parallel).
    expert_ranks = RankGenerator(tp=etp, ep=ep, dp=nnodes * nproc // (etp * ep * pp), pp=pp, cp=1, order=RANK_ORDER)
    # get_ranks("pp") lists the pipelines; stage s holds the s-th rank of every pipeline.
    stage_ranks = [[pipeline[s] for pipeline in ranks.get_ranks("pp")] for s in range(pp)]
    return Plan(
        model_name=config.model.name or (f"--load {config.checkpointing.load}" if config.checkpoint_info else
                                         "from the flags"),
        model=model, padded_vocab=vocab, nnodes=nnodes,
        nproc_per_node=nproc, tp=parallel.tensor_model_parallel_size, pp=pp, vpp=vpp,
        cp=parallel.context_parallel_size, dp=dp, sequence_parallel=parallel.sequence_parallel,
        recompute=parallel.recompute_granularity or "none", micro_batch_size=training.micro_batch_size,
        global_batch_size=gbs, train_iters=train_iters, precision=config.precision,
        distributed_optimizer=training.use_distributed_optimizer, stages=_stages(model, vocab, pp, vpp, stage_ranks),
        tp_groups=ranks.get_ranks("tp"), dp_groups=ranks.get_ranks("dp"), ep=ep, etp=etp,
        ep_groups=expert_ranks.get_ranks("ep"), expert_dp_groups=expert_ranks.get_ranks("dp"),
        lora=config.lora.settings,
    )


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(
        prog="python -m megatron_patch.training.plan", allow_abbrev=False,
        description="Print the plan of a rapidformer launch (layout, batches, memory per GPU) and exit; every "
                    "other flag is a rapidformer flag (see rapidformer --help).")
    parser.add_argument("--nnodes", type=int, default=int(os.environ.get("NNODES") or 1),
                        help="nodes in the job (default: $NNODES, else 1)")
    parser.add_argument("--train-tokens", type=int, default=None,
                        help="train for this many tokens: ceil(tokens / (global batch x seq length)) iterations")
    parser.add_argument("--print-train-iters", action="store_true",
                        help="print only the number of training iterations (for --train-tokens) and exit")
    own, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        plan = build_plan(rest, own.nnodes, own.train_tokens)
    except ValueError as error:
        raise SystemExit(f"dry run: error: {error}") from None
    if own.print_train_iters:
        if plan.train_iters is None:
            raise SystemExit("dry run: error: --print-train-iters needs --train-tokens or --train-iters")
        print(plan.train_iters)
    else:
        print(plan.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
