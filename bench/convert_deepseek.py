"""Peak memory of hf-to-megatron on a DeepSeek-V3-shaped checkpoint larger than the memory the conversion uses.

    PYTHONPATH=. python bench/convert_deepseek.py                 # ~4.3 GB bf16: 16 MoE layers of 64 experts
    PYTHONPATH=. python bench/convert_deepseek.py --moe-layers 2  # a small one, to check that it runs

Writes the safetensors files of a DeepSeek-V3-shaped model (multi-latent attention with query compression, one
dense layer, then MoE layers of routed experts, a shared expert and the router's score-correction bias in fp32)
straight from constant tensors (the values do not change what is held), then runs ``megatron-patch convert
hf-to-megatron --no-verify`` to torch_dist in a fresh process and samples its RSS every 20 ms (bench/convert.py's
``run_measured``). The converter streams: it holds the tensors being written and at most 1 GiB read ahead, plus the
libraries, so its peak stays flat as the model grows. Prints ``RESULT {json}``: peak RSS / checkpoint size.
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from convert import run_measured  # noqa: E402  (bench/ is not a package)


def write_model(out_dir: str, moe_layers: int, hidden: int = 1024, experts: int = 64, expert_ffn: int = 512,
                heads: int = 8, vocab: int = 32000) -> int:
    """A DeepSeek-V3-shaped checkpoint in 1 GiB shards; returns its size in bytes."""
    import torch
    from safetensors.torch import save_file

    q_rank, kv_rank, nope, rope, v = 256, 128, 64, 32, 64
    layers = 1 + moe_layers
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    fp32 = set()
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_a_proj.weight": (q_rank, hidden),
                       p + "self_attn.q_a_layernorm.weight": (q_rank,),
                       p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
                       p + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, hidden),
                       p + "self_attn.kv_a_layernorm.weight": (kv_rank,),
                       p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_rank),
                       p + "self_attn.o_proj.weight": (hidden, heads * v)})
        mlps = [(p + "mlp.", 4 * hidden)] if i == 0 else (
            [(f"{p}mlp.experts.{e}.", expert_ffn) for e in range(experts)] + [(p + "mlp.shared_experts.", expert_ffn)])
        for prefix, ffn in mlps:
            shapes.update({prefix + "gate_proj.weight": (ffn, hidden), prefix + "up_proj.weight": (ffn, hidden),
                           prefix + "down_proj.weight": (hidden, ffn)})
        if i:
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
            shapes[p + "mlp.gate.e_score_correction_bias"] = (experts,)
            fp32.add(p + "mlp.gate.e_score_correction_bias")
    total, shard, shard_bytes, k = 0, {}, 0, 0
    for name, shape in shapes.items():
        shard[name] = torch.full(shape, 0.01, dtype=torch.float32 if name in fp32 else torch.bfloat16)
        shard_bytes += shard[name].nbytes
        total += shard[name].nbytes
        if shard_bytes > 1 << 30 or name == list(shapes)[-1]:
            save_file(shard, os.path.join(out_dir, f"model-{k:05d}.safetensors"), metadata={"format": "pt"})
            k, shard, shard_bytes = k + 1, {}, 0
    config = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=expert_ffn,
                  num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=q_rank, kv_lora_rank=kv_rank,
                  qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, n_routed_experts=experts,
                  n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                  first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=4096, vocab_size=vocab,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, num_nextn_predict_layers=0, dtype="bfloat16",
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moe-layers", type=int, default=16)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        hf = os.path.join(work, "hf")
        os.makedirs(hf)
        size = write_model(hf, args.moe_layers)
        print(f"model: {size / 1e9:.2f} GB bf16, 1 dense + {args.moe_layers} MoE layers", flush=True)
        seconds, rss, anon, _ = run_measured([
            sys.executable, "-m", "megatron_patch.convert.cli", "hf-to-megatron", "--hf-dir", hf,
            "--save-dir", os.path.join(work, "mcore"), "--no-verify", "--no-progress"])
        print(f"convert: {seconds:.1f} s, peak RSS {rss / 1e9:.2f} GB (anonymous {anon / 1e9:.2f} GB)")
        print("RESULT " + json.dumps({
            "benchmark": "hf-to-megatron peak RSS vs checkpoint size, DeepSeek-V3-shaped",
            "ratio": round(rss / size, 2), "target": "< 1",
            "note": f"{size / 1e9:.2f} GB bf16 checkpoint; peak RSS {rss / 1e9:.2f} GB, anonymous "
                    f"{anon / 1e9:.2f} GB; {seconds:.1f} s"}), flush=True)


if __name__ == "__main__":
    main()
