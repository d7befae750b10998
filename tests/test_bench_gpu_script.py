"""The GPU throughput script's CPU-sized dry mode runs every case end to end, so the script cannot rot; its MoE
case counts the FLOPs of the active experts only and fits one H200."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch.model.builder import padded_vocab_size
from megatron_patch.model.config import get_model_config
from megatron_patch.model.flops import num_floating_point_operations, num_parameters

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_throughput import CASES  # noqa: E402  (bench/ is no package)


def test_gpu_throughput_dry_run_writes_a_row_per_case(tmp_path):
    out = tmp_path / "table.md"
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_throughput.sh"), "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env={"PYTHON": sys.executable,
                                                                              "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = out.read_text().splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [case.name for case in CASES]
    for row in rows:
        tokens_per_s, tflops = (float(cell) for cell in row.split(" | ")[4:6])
        assert tokens_per_s > 0 and tflops > 0


def test_moe_case_counts_active_experts_and_fits_one_h200():
    [case] = [case for case in CASES if get_model_config(case.model).num_moe_experts]
    m = get_model_config(case.model, num_layers=case.num_layers)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    tokens, s, h = case.micro_batch_size * case.num_microbatches * case.seq_length, case.seq_length, m.hidden_size
    q_size, kv_size, expert_width = m.kv_channels * m.num_attention_heads, m.kv_channels * m.num_query_groups, 14336
    # Every GEMM a token meets, by hand from Mixtral's shapes: 2 FLOPs per multiply-add, x3 for forward and backward,
    # and only the 2 of 8 experts it is routed to (the router's small GEMM left out, as Megatron-LM does).
    per_token_layer = (2 * h * (q_size + 2 * kv_size) + 2 * 2 * s * q_size + 2 * q_size * h
                       + 2 * (2 * h * 2 * expert_width + 2 * expert_width * h))
    expected = 3 * tokens * (m.num_layers * per_token_layer + 2 * h * vocab)
    assert num_floating_point_operations(m, tokens // s, s, vocab) == pytest.approx(expected, rel=1e-12)
    # bf16 weights, fp32 grads, main weights and Adam moments, and foreach AdamW's one fp32 temporary: 22 bytes a
    # parameter; what is left of the H200's 139 GiB holds the activations and the allocator's slack.
    assert 22 * num_parameters(m, vocab) / 2**30 < 100
