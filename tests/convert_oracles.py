"""Tiny random Hugging Face models (built from config classes, nothing downloaded) and the rank bodies of the
conversion tests (module level, so run_on_ranks' workers can import them)."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import sys

from megatron_patch.testing import run_on_ranks

VOCAB = 100  # not a multiple of 128: every conversion pads and trims the vocabulary
_SMALL = dict(vocab_size=VOCAB, max_position_embeddings=32)
_BERT = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, intermediate_size=64, **_SMALL)

# name -> (config class, config kwargs, model class)
HF_MODELS = {
    "gpt2": ("GPT2Config", dict(n_layer=4, n_embd=32, n_head=4, n_positions=32, vocab_size=VOCAB,
                                bos_token_id=0, eos_token_id=0), "GPT2LMHeadModel"),
    "llama-gqa": ("LlamaConfig", dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, rope_theta=50000.0,
                                      tie_word_embeddings=False, **_SMALL), "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=48, tie_word_embeddings=True, **_SMALL), "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=False,
                                      **_SMALL), "MistralForCausalLM"),
    # head_dim 16, not hidden / heads = 8: the q/k norms and projections follow head_dim.
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=48, tie_word_embeddings=True, **_SMALL),
              "Qwen3ForCausalLM"),
    # LLaMA 3.1's scaled RoPE. At 16 positions the scaled low frequencies move random-init logits by ~1e-5 only;
    # weights of std 0.2 sharpen attention until unscaled RoPE is 3e-3 off, far above the 1e-4 the test allows.
    "llama3.1": ("LlamaConfig", dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=16, intermediate_size=48, tie_word_embeddings=False,
                                     initializer_range=0.2, rope_parameters=dict(
                                         rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=8192), **_SMALL),
                 "LlamaForCausalLM"),
    # Phi-3's fused q/k/v in two key/value groups (cut by their width, not in thirds) and RoPE over half of each head.
    "phi3": ("Phi3Config", dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=48, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0,
                                eos_token_id=0, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                     partial_rotary_factor=0.5), **_SMALL),
             "Phi3ForCausalLM"),
    # Gemma 3: a window of 5 tokens in the sliding layers (each pipeline stage of two has one of each kind), their
    # own RoPE base, linear scaling by 8 in the full layers, head_dim 16 beside hidden / heads = 8, scores scaled by
    # 24 ** -0.5, weights of std 0.2 so the window and both RoPEs move the logits far beyond the test's 1e-4.
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, intermediate_size=48, sliding_window=5,
                                        layer_types=["sliding_attention", "full_attention"] * 2,
                                        query_pre_attn_scalar=24, initializer_range=0.2, pad_token_id=0,
                                        bos_token_id=0, eos_token_id=0, rope_parameters=dict(
                                            full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                            sliding_attention=dict(rope_type="default", rope_theta=1e4)), **_SMALL),
               "Gemma3ForCausalLM"),
    "bert-pretraining": ("BertConfig", _BERT, "BertForPreTraining"),
    "bert-mlm": ("BertConfig", _BERT, "BertForMaskedLM"),
    "bert-encoder": ("BertConfig", _BERT, "BertModel"),
}

# Mixture-of-experts models: 2 layers, hidden 64, 4 experts of width 32, 2 per token, GQA, an odd vocabulary.
# Router weights of std 0.2 (not 0.02) keep the top-2 choice clear of near-ties, where the two libraries' rounding
# (the top k of the logits vs of their softmax) could pick different experts.
MOE_VOCAB = 101
_MOE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
            vocab_size=MOE_VOCAB, max_position_embeddings=32, initializer_range=0.2)
MOE_MODELS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=32, **_MOE), "MixtralForCausalLM"),
    # norm_topk_prob false (Qwen1.5-MoE's): the top-2 softmax weights as they are, --moe-router-pre-softmax.
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         intermediate_size=128, norm_topk_prob=False, **_MOE), "Qwen2MoeForCausalLM"),
    # norm_topk_prob true (Qwen3-30B-A3B's), head_dim 32 rather than hidden / heads, tied embeddings.
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=32, intermediate_size=128, head_dim=32,
                                         norm_topk_prob=True, tie_word_embeddings=True, **_MOE),
                  "Qwen3MoeForCausalLM"),
}

# DeepSeek-V3 and -V2 (multi-latent attention): 4 layers (PP=2 splits them), the first dense; 4 experts of width 32
# and a shared one, 2 per token. V3: query rank 32, sigmoid routing from 1 of 2 groups with a random
# score-correction bias, weights x 2.5, YaRN with mscale. V2 (Lite's shape): no query compression, softmax routing,
# top 2 not renormalised.
_MLA = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            vocab_size=MOE_VOCAB, max_position_embeddings=32, initializer_range=0.2)
DEEPSEEK_MODELS = {
    "deepseek-v3": ("DeepseekV3Config", dict(
        _MLA, q_lora_rank=32, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)), "DeepseekV3ForCausalLM"),
    "deepseek-v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                    "DeepseekV2ForCausalLM"),
    # GLM-4.5's attention: GQA with q/k/v biases, per-head q/k norms, RoPE on half of each 32-channel head.
    "glm4-moe": ("Glm4MoeConfig", dict(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True, vocab_size=MOE_VOCAB, max_position_embeddings=32, initializer_range=0.2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
        "Glm4MoeForCausalLM"),
}


def make_hf_model(name: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """A random model of kind ``name`` (its config fields changed by ``overrides``) saved with save_pretrained
    (biases and norms randomised too, so that a wrong mapping of any tensor shows in the outputs)."""
    import torch
    import transformers

    config_class, kwargs, model_class = {**HF_MODELS, **MOE_MODELS, **DEEPSEEK_MODELS}[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**kwargs, **overrides}))
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname.lower() or "ln_" in pname:
                param.add_(0.1 * torch.randn_like(param))
        # DeepSeek-V3's score-correction bias is a buffer: random, so that a router without it picks other experts.
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(out_dir)
    return out_dir


def hf_tensors(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_bit_exact(original_dir: str, exported_dir: str) -> None:
    import torch

    a, b = hf_tensors(original_dir), hf_tensors(exported_dir)
    assert a.keys() == b.keys(), f"tensor names differ: {sorted(a.keys() ^ b.keys())}"
    differing = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differing, f"tensors differ after the round trip: {differing}"


class ExitStatus(int):
    """A command's exit status that carries what it printed, shown when a test's assertion on it fails: a worker's
    own output goes to the pool's log, out of pytest's sight."""

    def __new__(cls, status: int, output: str):
        self = super().__new__(cls, status)
        self.output = output
        return self

    def __getnewargs__(self):
        return int(self), self.output

    def __repr__(self):
        return f"{int(self)} (the command printed: {self.output[-3000:]!r})" if self else "0"


class _Tee(io.StringIO):
    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def write(self, text):
        self.stream.write(text)
        return super().write(text)


def cli(rank, world_size, argv):
    """``megatron-patch convert ...`` in a worker (a one-rank world): its exit status, with what it printed."""
    from megatron_patch.convert.cli import main

    out, err = _Tee(sys.stdout), _Tee(sys.stderr)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return ExitStatus(status, out.getvalue() + err.getvalue())


def convert_command(argv: list[str], timeout: float = 300) -> ExitStatus:
    """``megatron-patch convert ARGV`` as a user runs it, in a process of its own: for a conversion that verifies
    itself at an expert-parallel size (it starts torchrun on two ranks), which from inside a rank pool's long-lived
    worker hung in CI once the worker had run other tests' conversions."""
    import subprocess

    pool_variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in pool_variables}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update(PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", "convert", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)
    return ExitStatus(done.returncode, done.stdout + done.stderr)


def verify_layouts(rank, world_size, hf_dir, megatron_dir, layouts, resave_dir=None):
    """verify_on_rank at each (tp, pp) or (tp, pp, ep); optionally re-save the checkpoint from the last layout (a
    reshard)."""
    from megatron_patch.convert.verify import verify_on_rank

    results = {}
    for layout in layouts:
        comparisons = verify_on_rank(hf_dir, megatron_dir, *layout[:2], ep=(*layout, 1)[2])
        if comparisons is not None:
            results.setdefault(layout, comparisons)
    gathered = [None] * world_size
    import torch

    torch.distributed.all_gather_object(gathered, results)
    merged = {}
    for r in gathered:
        merged.update(r)
    if resave_dir is not None:
        resave(megatron_dir, resave_dir, *layouts[-1])
    return merged if rank == 0 else None


def verify_each(rank, world_size, jobs):
    """:func:`verify_layouts` for each ``(hf_dir, megatron_dir, layouts, resave_dir)`` in one start of the ranks."""
    return [verify_layouts(rank, world_size, *job) for job in jobs]


def assert_layouts_match_transformers(converted: dict, layouts: list) -> None:
    """Every converted model (name -> (hf dir, torch_dist dir, root)) at every (TP, PP, EP) of ``layouts``, on 4
    ranks started once, gives transformers' logits to 1e-4; the last layout re-saves each to ROOT/NAME-resaved."""
    jobs = [(hf, dist, layouts, os.path.join(root, f"{name}-resaved")) for name, (hf, dist, root) in converted.items()]
    results = run_on_ranks(verify_each, 4, args=(jobs,), timeout=400)[0]
    failures = [f"{name} TP{tp}xPP{pp}xEP{ep}: {c.line()}"
                for name, by_layout in zip(converted, results) for (tp, pp, ep), comparisons in by_layout.items()
                for c in comparisons if not (c.passed and c.max_rel_diff <= 1e-4)]
    assert [set(r) for r in results] == [set(layouts)] * len(converted)
    assert not failures, "\n".join(failures)


def assert_round_trips_bit_exact(converted: dict, layouts: list) -> None:
    """megatron-to-hf of each converted model, and of its re-save by the last layout's ranks (made here when the
    layout test did not run first), gives the Hugging Face tensors back bit for bit."""
    for name, (hf, dist, root) in converted.items():
        resaved = os.path.join(root, f"{name}-resaved")
        if not os.path.exists(resaved):
            run_on_ranks(verify_each, 4, args=([(hf, dist, layouts[-1:], resaved)],), timeout=300)
        for source in (dist, resaved):
            out = f"{source}-exported"
            assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", source, "--save-dir", out,
                                               "--no-progress", "--overwrite"],), timeout=120) == [0]
            assert_bit_exact(hf, out)


def local_expert_weights(rank, world_size, megatron_dir, ep):
    """This rank's expert parallel rank and its experts' linear_fc2 weights in layer 0, loaded at EP=``ep``."""
    from megatron.core import parallel_state

    from megatron_patch.checkpoint.format import read_info
    from megatron_patch.convert.verify import build_and_load

    info = read_info(megatron_dir)
    [chunk] = build_and_load(megatron_dir, info, 1, 1, "float32", ep)
    local = chunk.decoder.layers[0].mlp.experts.local_experts
    return parallel_state.get_expert_model_parallel_rank(), [e.linear_fc2.weight.detach().clone() for e in local]


def resave(megatron_dir, out_dir, tp, pp, ep=1):
    """Load at TP x PP x EP and save a torch_dist checkpoint from all ranks (what a trainer's save does)."""
    import shutil

    import torch
    from megatron.core import dist_checkpointing

    from megatron_patch.checkpoint.format import ARGS_FILE, TRACKER_FILE, read_info
    from megatron_patch.convert.verify import build_and_load

    info = read_info(megatron_dir)
    [chunk] = build_and_load(megatron_dir, info, tp, pp, "float32", ep)
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.join(out_dir, "release"), exist_ok=True)
        for name in (ARGS_FILE, TRACKER_FILE):
            shutil.copy(os.path.join(megatron_dir, name), out_dir)
    torch.distributed.barrier()
    dist_checkpointing.save(chunk.sharded_state_dict(), os.path.join(out_dir, "release"))


# ----------------------------------------------------------------------------------------------------------
# Converted checkpoint -> our trainer -> megatron-to-hf -> transformers' generate
# ----------------------------------------------------------------------------------------------------------


def training_sequences(count: int = 4, length: int = 17, seed: int = 1) -> list[list[int]]:
    """Fixed random token sequences (the whole training set: a few steps on them lower the loss)."""
    import torch

    return torch.randint(0, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()


def _fixed_data_pretrainer(sequences: list[list[int]]):
    """The black-box GPT Pretrainer on ``sequences`` (no tokenizer or data files: the model comes from ``--load``'s
    megatron_patch_args.json)."""
    import torch

    from megatron_patch.training.tasks import MegatronGPTPretrainer

    samples = [{"tokens": torch.tensor(s[:-1]), "labels": torch.tensor(s[1:]),
                "loss_mask": torch.ones(len(s) - 1), "position_ids": torch.arange(len(s) - 1)} for s in sequences]

    class FixedDataPretrainer(MegatronGPTPretrainer):
        def train_valid_test_datasets_provider(self, train_val_test_num_samples):
            return samples, None, None

    return FixedDataPretrainer


def megatron_greedy(chunks, info, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding by megatron-core: the argmax of the last position's logits (padded rows cut off),
    appended and run again from the start (no KV cache, so nothing but the forward pass is involved)."""
    import torch

    from megatron_patch.convert.verify import megatron_outputs

    tokens = torch.tensor([prompt])
    for _ in range(new_tokens):
        inputs = {"tokens": tokens, "position_ids": torch.arange(tokens.shape[1])[None]}
        logits = megatron_outputs(chunks, info, inputs, {"logits"})["logits"]
        next_token = logits[0, -1, :info.model_config.vocab_size].argmax()
        tokens = torch.cat([tokens, next_token.view(1, 1)], dim=1)
    return tokens[0, len(prompt):].tolist()


def megatron_greedy_at(rank, world_size, megatron_dir, tp, prompt, new_tokens, ep=1):
    """Greedy decoding by the converted checkpoint loaded at TP=``tp``, EP=``ep`` (every rank returns the tokens)."""
    from megatron_patch.checkpoint.format import read_info
    from megatron_patch.convert.verify import build_and_load

    info = read_info(megatron_dir)
    return megatron_greedy(build_and_load(megatron_dir, info, tp, 1, "float32", ep), info, prompt, new_tokens)


def hf_greedy(rank, world_size, hf_dir, prompt, new_tokens):
    """transformers' greedy ``generate`` of the model in ``hf_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    # No end-of-sequence token: a random model may emit it, and generate would stop early.
    greedy = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         generation_config=greedy)
    return out[0, len(prompt):].tolist()


def train_converted(rank, world_size, argv, sequences, prompt, new_tokens):
    """Train with the GPT Pretrainer (flags ``argv``: ``--load`` a converted checkpoint, ``--save``); return the
    losses and the trained model's greedy continuation of ``prompt``."""
    from megatron_patch.training.engine import Engine

    trainer = _fixed_data_pretrainer(sequences)(engine=Engine(argv))
    log = trainer.train()
    tokens = megatron_greedy(trainer.model, trainer.checkpoint_info, prompt, new_tokens)
    return {"losses": [loss for _, loss in log.train_losses], "tokens": tokens}


def hf_reference(rank, world_size, original_dir, exported_dir, sequences, padded_vocab, prompt, new_tokens):
    """transformers' loss of the original model on ``sequences`` (what the trainer's first step must report)
    and the greedy ``generate`` of the exported model."""
    import torch
    from transformers import AutoModelForCausalLM

    batch = torch.tensor(sequences)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(original_dir).eval()(input_ids=batch[:, :-1]).logits
    # Megatron's softmax also spans the padded vocabulary rows, whose output weights (zeros) give logit 0.
    logits = torch.nn.functional.pad(logits, (0, padded_vocab - logits.shape[-1]))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    return {"loss": loss, "tokens": hf_greedy(rank, world_size, exported_dir, prompt, new_tokens)}


def add_mtp_layer(hf_dir: str, seed: int = 1) -> None:
    """Give a DeepSeek-V3 directory what the published checkpoint has and transformers does not save: a multi-token
    prediction layer after the last (random weights of the last layer's shapes, its norms and projection of
    [embedding; hidden]; copies of the embedding and output matrices), in a safetensors file of its own."""
    import json

    import torch
    from safetensors.torch import save_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        last = json.load(f)["num_hidden_layers"]
    source = hf_tensors(hf_dir)
    generator = torch.Generator().manual_seed(seed)
    prefix, mtp = f"model.layers.{last - 1}.", f"model.layers.{last}."
    tensors = {mtp + name[len(prefix):]: 0.2 * torch.randn(t.shape, generator=generator)
               for name, t in source.items() if name.startswith(prefix)}
    hidden = source["model.norm.weight"].shape[0]
    tensors.update({mtp + "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
                    mtp + "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
                    mtp + "eh_proj.weight": 0.2 * torch.randn(hidden, 2 * hidden, generator=generator),
                    mtp + "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
                    mtp + "shared_head.head.weight": source["lm_head.weight"].clone(),
                    mtp + "embed_tokens.weight": source["model.embed_tokens.weight"].clone()})
    save_file(tensors, os.path.join(hf_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
