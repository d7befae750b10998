"""Run the Hugging Face model and the converted Megatron model on the same inputs and compare their outputs.

Example::

    megatron-patch convert verify --hf-dir llama-hf --megatron-dir llama-mcore \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2          # torchrun on 4 processes
    megatron-patch convert verify --hf-dir mixtral-hf --megatron-dir mixtral-mcore \\
        --expert-model-parallel-size 2                                          # each rank runs half the experts

    logits: max abs diff 3.1e-07, max rel diff 2.4e-07, cosine 1.0000000, top-1 100.0%, top-5 100.0%  PASS

Before anything is built, the two directories' config files must describe the same model (``core.check_pair``).
The oracle is transformers' own forward pass; the Megatron model is loaded at the TP x PP (x EP) asked for
(``checkpoint.load.load_into_chunks``) and run through megatron-core's schedule (``model.forward.forward_only``).
Compared are the LM logits (the padded vocabulary rows trimmed), BERT's sentence-relation logits where the
checkpoint has that head, and for encoder-only BERT the last hidden states, padded positions included (attention
masks exercised). The run fails, and the command exits non-zero, when the relative difference or the cosine
similarity is outside the threshold for the dtype.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from megatron_patch.checkpoint.format import DTYPES, CheckpointInfo
from megatron_patch.checkpoint.load import load_into_chunks
from megatron_patch.convert.core import check_pair
from megatron_patch.model.conversion import compared_outputs
from megatron_patch.model.forward import forward_only

# (max relative difference, min cosine similarity, min top-1 agreement) per dtype the models run in.
THRESHOLDS = {
    "float32": (1e-4, 0.99999, 0.95),
    "bfloat16": (5e-2, 0.999, 0.8),
    "float16": (1e-2, 0.9999, 0.9),
}



@dataclasses.dataclass
class Comparison:
    """How far one Megatron output is from the Hugging Face one."""

    output: str
    max_abs_diff: float
    max_rel_diff: float
    """max |megatron - hf| / max |hf|."""
    cosine: float
    top1: float | None
    top5: float | None
    passed: bool

    def line(self) -> str:
        top = "" if self.top1 is None else f", top-1 {100 * self.top1:.1f}%, top-5 {100 * self.top5:.1f}%"
        return (f"{self.output}: max abs diff {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}, "
                f"cosine {self.cosine:.7f}{top}  {'PASS' if self.passed else 'FAIL'}")


def compare(output: str, actual: torch.Tensor, expected: torch.Tensor, dtype: str = "float32") -> Comparison:
    """Compare ``actual`` (Megatron) with ``expected`` (Hugging Face) of the same shape.

    Example::

        >>> compare("logits", torch.ones(1, 2, 8), torch.ones(1, 2, 8)).passed
        True
    """
    max_rel, min_cos, min_top1 = THRESHOLDS[dtype]
    a, e = actual.double(), expected.double()
    diff = (a - e).abs().max().item()
    rel = diff / max(e.abs().max().item(), 1e-30)
    cosine = torch.nn.functional.cosine_similarity(a.flatten(), e.flatten(), dim=0).item()
    top1 = top5 = None
    if output.endswith("logits") and e.shape[-1] > 5:
        top1 = (a.argmax(-1) == e.argmax(-1)).double().mean().item()
        ta, te = a.topk(5, dim=-1).indices, e.topk(5, dim=-1).indices
        top5 = (ta.unsqueeze(-1) == te.unsqueeze(-2)).any(-1).double().mean().item()
    passed = rel <= max_rel and cosine >= min_cos and (top1 is None or top1 >= min_top1)
    return Comparison(output, diff, rel, cosine, top1, top5, passed)


def make_inputs(info: CheckpointInfo, hf_dir: str, text: str | None = None, batch: int = 2, seq: int = 16,
                seed: int = 0) -> dict:
    """Token ids (from ``text`` with the checkpoint's tokenizer, or random), position ids, and for BERT an
    attention mask that pads the end of the second sequence and token types that mark a second segment."""
    m = info.model_config
    seq = min(seq, m.max_positions)
    if text is not None:
        from transformers import AutoTokenizer

        tokens = AutoTokenizer.from_pretrained(hf_dir)(text, return_tensors="pt")["input_ids"][:, :m.max_positions]
    else:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, m.vocab_size, (batch, seq), generator=gen)
    b, s = tokens.shape
    attention_mask = torch.ones(b, s, dtype=torch.long)
    inputs = {"tokens": tokens, "position_ids": torch.arange(s).expand(b, s).contiguous()}
    if m.family == "bert":
        if b > 1:
            attention_mask[1, s - s // 4:] = 0
        inputs["types"] = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous() if m.num_tokentypes else None
    inputs["attention_mask"] = attention_mask
    return inputs


def _sequence_parallel(info: CheckpointInfo, tp: int) -> bool:
    """megatron-core's MoELayer asserts sequence parallelism under TP > 1 (moe_layer.py); a forward is the same."""
    return tp > 1 and info.model_config.num_moe_experts is not None


def pad_to_multiple(inputs: dict, multiple: int) -> dict:
    """A GPT's ``inputs`` with each sequence lengthened to a multiple of ``multiple`` by repeating its last token.

    Example::

        >>> pad_to_multiple({"tokens": torch.tensor([[5, 6, 7]]), "position_ids": torch.arange(3)[None],
        ...                  "attention_mask": torch.ones(1, 3, dtype=torch.long)}, 2)["tokens"]
        tensor([[5, 6, 7, 7]])

    Sequence parallelism splits the sequence over the TP ranks, so its length must divide by TP; a ``--text`` has
    any length. The model is causal: its outputs at the text's own positions do not depend on the tokens after them,
    and those are the ones compared.
    """
    tokens = inputs["tokens"]
    b, s = tokens.shape
    extra = -s % multiple
    if not extra:
        return inputs
    padded = s + extra
    return {**inputs, "tokens": torch.cat([tokens, tokens[:, -1:].expand(b, extra)], dim=1),
            "position_ids": torch.arange(padded).expand(b, padded).contiguous(),
            "attention_mask": torch.ones(b, padded, dtype=torch.long)}


def hf_outputs(hf_dir: str, architecture: str, inputs: dict, dtype: str = "float32") -> dict[str, torch.Tensor]:
    import transformers

    from megatron_patch.startup import paused_collector

    if not sys.stderr.isatty():  # transformers' "Loading weights" bar, drawn with \r into a log or a pipe
        transformers.utils.logging.disable_progress_bar()
    with paused_collector():  # the first use of a model class imports its module: 0.8 s less (startup.py)
        model = getattr(transformers, architecture).from_pretrained(hf_dir, dtype=DTYPES[dtype].torch).eval()
    kwargs = {"input_ids": inputs["tokens"], "attention_mask": inputs["attention_mask"]}
    if inputs.get("types") is not None:
        kwargs["token_type_ids"] = inputs["types"]
    with torch.no_grad():
        out = model(**kwargs)
    return {name: getattr(out, attr).float() for name, attr in compared_outputs(architecture).items()}


def _forward_step(family: str, wanted: set[str]):
    from megatron.core import tensor_parallel

    def forward_step(data_iterator, model):
        inputs = next(data_iterator)
        captured = {}
        if "hidden_states" in wanted and getattr(model, "post_process", False):
            model.encoder.register_forward_hook(lambda mod, args, out: captured.setdefault("hidden", out))
        if family == "gpt":
            output = model(inputs["tokens"], inputs["position_ids"], None)
        else:
            output = model(inputs["tokens"], inputs["attention_mask"], tokentype_ids=inputs.get("types"))

        def collect(output, non_loss_data=True):
            result = {}
            logits, binary = (output, None) if family == "gpt" else output
            result["logits"] = tensor_parallel.gather_from_tensor_model_parallel_region(logits).float()
            if binary is not None:
                result["binary_logits"] = binary.float()
            if "hidden" in captured:
                result["hidden_states"] = captured["hidden"].transpose(0, 1).float()
            return result

        return output, collect

    return forward_step


def megatron_outputs(chunks, info: CheckpointInfo, inputs: dict, wanted: set[str]) -> dict | None:
    """Forward through this rank's chunks with megatron-core's pipeline schedule; outputs on the last stage, in
    the CPU's memory (where transformers' reference runs)."""
    device = next(chunks[0].parameters()).device
    for chunk in chunks:
        chunk.eval()
    inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in inputs.items()}
    collected = forward_only(chunks, [inputs], _forward_step(info.model_config.family, wanted),
                             seq_length=inputs["tokens"].shape[1], collect_non_loss_data=True)
    return {name: value.cpu() for name, value in collected[0].items()} if collected else None


def build_and_load(megatron_dir: str, info: CheckpointInfo, tp: int, pp: int, dtype: str, ep: int = 1):
    """This rank's chunks at TP x PP x EP with the checkpoint's weights, in torchrun's world or, in a process of its
    own, a world of one rank (destroyed at the end of a ``distributed.one_rank_world()`` block around the call)."""
    from megatron_patch.distributed import initialize_distributed, start_one_rank_world
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.parallel import ParallelConfig

    start_one_rank_world()
    initialize_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           expert_model_parallel_size=ep, seed=1234)
    config = info.model_config.replace(hidden_dropout=0.0, attention_dropout=0.0)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep, sequence_parallel=_sequence_parallel(info, tp),
                              precision={"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32"))
    chunks = build_model_chunks(config, parallel, info.padded_vocab_size)
    load_into_chunks(chunks, megatron_dir, info)
    return chunks


def verify_on_rank(hf_dir: str, megatron_dir: str, tp: int = 1, pp: int = 1, text: str | None = None,
                   dtype: str = "float32", ep: int = 1) -> list[Comparison] | None:
    """Compare under TP x PP (x EP: the world is TP x PP x EP ranks); every rank of the world calls this. Returns
    the comparisons on the ranks that hold the outputs (last pipeline stage, TP rank 0), None on the others."""
    from megatron.core import parallel_state

    info, architecture = check_pair(hf_dir, megatron_dir)
    wanted = set(compared_outputs(architecture))
    inputs = make_inputs(info, hf_dir, text)
    length = inputs["tokens"].shape[1]
    # The main model only: transformers ignores multi-token prediction layers, and megatron-core's GPTModel runs them
    # only to compute their loss from labels (GPTModel._postprocess at core_v0.16.1), not for logits.
    main = dataclasses.replace(info, model_config=info.model_config.replace(mtp_num_layers=None))
    chunks = build_and_load(megatron_dir, main, tp, pp, dtype, ep)
    model_inputs = pad_to_multiple(inputs, tp) if _sequence_parallel(info, tp) else inputs
    actual = megatron_outputs(chunks, info, model_inputs, wanted)
    if not (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0):
        return None
    expected = hf_outputs(hf_dir, architecture, inputs, dtype)
    vocab = info.model_config.vocab_size
    results = []
    for name, hf_value in expected.items():
        # (batch, sequence, vocabulary): the text's own positions (pad_to_multiple), the model's own vocabulary
        value = actual[name][:, :length, :vocab] if name == "logits" else actual[name]
        if value.shape != hf_value.shape:
            raise ValueError(f"{name}: Megatron output has shape {tuple(value.shape)}, Hugging Face "
                             f"{tuple(hf_value.shape)}")
        results.append(compare(name, value, hf_value, dtype))
    return results
