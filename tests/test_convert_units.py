"""The named transforms against hand-built tensors in megatron-core's documented layouts, and the mapping
tables against what megatron-core's models actually hold."""

import os

import pytest
import torch

from megatron_patch.model.conversion import FAMILIES, UnsupportedCheckpoint, family_for
from megatron_patch.model.config import MODEL_TYPES, get_model_config, is_model_type
from megatron_patch.convert.transforms import TRANSFORMS, Shapes, apply_to_hf, apply_to_mcore

GQA = Shapes(num_attention_heads=4, num_query_groups=2, kv_channels=2, vocab_size=5, padded_vocab_size=8)


def _rows(prefix: int, n: int, width: int = 3) -> torch.Tensor:
    """Rows labelled prefix*100 + row index, so a layout can be read off the first column."""
    return (prefix * 100 + torch.arange(n)).float()[:, None].expand(n, width).contiguous()


def test_fuse_qkv_is_grouped_per_query_group():
    # 4 heads x 2 dims of q, 2 groups x 2 dims of k and v; group g takes q heads 2g, 2g+1 then k_g, v_g
    # (SelfAttention.get_query_key_value_tensors).
    q, k, v = _rows(1, 8), _rows(2, 4), _rows(3, 4)
    [qkv] = apply_to_mcore(("fuse_qkv",), [q, k, v], GQA)
    assert qkv[:, 0].tolist() == [100, 101, 102, 103, 200, 201, 300, 301,
                                  104, 105, 106, 107, 202, 203, 302, 303]
    # TP=2 takes whole groups: the first half of the rows is group 0.
    assert set(qkv.chunk(2)[0][:, 0].tolist()) == {100, 101, 102, 103, 200, 201, 300, 301}
    for original, back in zip((q, k, v), apply_to_hf(("fuse_qkv",), qkv, GQA)):
        assert torch.equal(original, back)


def test_gpt2_conv1d_qkv_transposes_then_groups():
    mha = Shapes(num_attention_heads=2, num_query_groups=2, kv_channels=1, vocab_size=1, padded_vocab_size=1)
    c_attn = torch.arange(12.).reshape(2, 6)  # Conv1D [in=2, out=3 x 2]: columns q0 q1 k0 k1 v0 v1
    [qkv] = apply_to_mcore(("transpose", "fuse_stacked_qkv"), [c_attn], mha)
    assert qkv[:, 0].tolist() == [0, 2, 4, 1, 3, 5]  # q0 k0 v0 q1 k1 v1
    [back] = apply_to_hf(("transpose", "fuse_stacked_qkv"), qkv, mha)
    assert torch.equal(back, c_attn)


def test_gate_up_and_vocab_padding_round_trip():
    gate, up = _rows(1, 4), _rows(2, 4)
    [fc1] = apply_to_mcore(("fuse_gate_up",), [gate, up], GQA)
    assert fc1[:, 0].tolist() == [100, 101, 102, 103, 200, 201, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip((gate, up), apply_to_hf(("fuse_gate_up",), fc1, GQA)))
    emb = torch.randn(5, 3)
    [padded] = apply_to_mcore(("pad_vocab",), [emb], GQA)
    assert padded.shape == (8, 3) and torch.equal(padded[:5], emb) and not padded[5:].any()
    assert torch.equal(apply_to_hf(("pad_vocab",), padded, GQA)[0], emb)
    with pytest.raises(ValueError, match="vocab_size 5"):
        apply_to_mcore(("pad_vocab",), [torch.randn(6, 3)], GQA)


# Inputs of each transform in Hugging Face layout (GQA shapes above).
_HF_INPUTS = {
    "transpose": lambda: [torch.randn(3, 5)],
    "fuse_qkv": lambda: [torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)],
    "fuse_stacked_qkv": lambda: [torch.randn(24)],
    "fuse_gate_up": lambda: [torch.randn(6, 3), torch.randn(6, 3)],
    "pad_vocab": lambda: [torch.randn(5, 3)],
    "shared_copy": lambda: [torch.randn(5, 3)] * 2,
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transform_inverts_bit_exactly(name):
    shapes = Shapes(num_attention_heads=4, num_query_groups=4, kv_channels=2, vocab_size=5, padded_vocab_size=8) \
        if name == "fuse_stacked_qkv" else GQA
    inputs = _HF_INPUTS[name]()
    [mcore] = apply_to_mcore((name,), inputs, shapes)
    back = apply_to_hf((name,), mcore, shapes)
    assert len(back) == len(inputs) and all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(inputs, back))


def test_registry_is_keyed_by_model_type():
    assert {"gpt2", "llama", "qwen2", "bert"} <= set(FAMILIES)
    with pytest.raises(UnsupportedCheckpoint, match="model_type 't5'.*supported model types"):
        family_for({"model_type": "t5"})


# A named configuration of each Hugging Face model type.
NAMED_OF_TYPE = {"gpt2": "tiny-gpt2", "llama": "tiny-llama", "mistral": "mistral-7b", "qwen2": "tiny-qwen2",
                 "qwen3": "tiny-qwen3", "mixtral": "tiny-mixtral", "qwen2_moe": "tiny-qwen2-moe",
                 "qwen3_moe": "tiny-qwen3-moe", "bert": "tiny-bert", "deepseek_v3": "tiny-deepseek-v3",
                 "deepseek_v2": "deepseek-v2-lite", "glm4_moe": "glm-4.5", "phi3": "tiny-phi3",
                 "gemma3_text": "tiny-gemma3"}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_named_configs_and_the_converter_share_the_model_type_table(model_type):
    """The named configuration, its config.json and the model the converter reads back are the same model, of the
    type's row in MODEL_TYPES."""
    assert set(MODEL_TYPES) == set(FAMILIES)
    named = get_model_config(NAMED_OF_TYPE[model_type])
    family = FAMILIES[model_type]
    read_back = family.config_from_hf({**family.config_to_hf(named), "model_type": model_type,
                                       "architectures": [family.architectures[0]]})
    assert is_model_type(named, model_type) and is_model_type(read_back, model_type)
    # config.json has no training length and no vocabulary padding; Mixtral's has no dense MLP width (its
    # intermediate_size is an expert's).
    unsaid = dict(seq_length=named.max_positions, max_position_embeddings=named.max_positions,
                  make_vocab_size_divisible_by=read_back.make_vocab_size_divisible_by)
    if model_type == "mixtral":
        unsaid["ffn_hidden_size"] = named.moe_ffn_hidden_size
    assert read_back == named.replace(**unsaid)


def test_unsupported_options_are_named():
    llama = family_for({"model_type": "llama"})
    base = dict(model_type="llama", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, max_position_embeddings=32, vocab_size=100)
    assert llama.config_from_hf({**base, "rope_theta": 500000.0}).rotary_base == 500000
    assert llama.config_from_hf({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
                                ).rotary_base == 1000000
    with pytest.raises(UnsupportedCheckpoint, match="RoPE scaling 'llama3'"):
        llama.config_from_hf({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "llama3"}})
    with pytest.raises(UnsupportedCheckpoint, match="attention_bias=True"):
        llama.config_from_hf({**base, "attention_bias": True})
    # transformers would give a missing MLP width its class default (11008), not 4 x hidden: refused, not guessed.
    with pytest.raises(KeyError, match="intermediate_size"):
        llama.config_from_hf({k: v for k, v in base.items() if k != "intermediate_size"})


def test_the_chat_templates_survive_the_round_trip(tmp_path):
    """hf-to-megatron keeps the tokenizer's chat templates (transformers writes them to chat_template.jinja and
    additional_chat_templates/), and megatron-to-hf puts them back."""
    import tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_patch.testing import run_on_ranks
    from tests.convert_oracles import cli, make_hf_model

    hf = make_hf_model("qwen2", str(tmp_path / "hf"))
    vocab = {word: i for i, word in enumerate(["<unk>", "<|im_end|>", "hello", "there"])}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>", eos_token="<|im_end|>")
    tokenizer.chat_template = {
        "default": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}",
        "tool_use": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}",
    }
    tokenizer.save_pretrained(hf)
    assert os.path.isfile(os.path.join(hf, "chat_template.jinja"))
    converted, exported = str(tmp_path / "converted"), str(tmp_path / "exported")
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", converted, "--no-verify",
                                       "--no-progress"],)) == [0]
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", converted, "--save-dir", exported,
                                       "--no-progress"],)) == [0]
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}]
    for name in ("default", "tool_use"):
        expected = tokenizer.apply_chat_template(messages, chat_template=name, tokenize=False)
        got = AutoTokenizer.from_pretrained(exported).apply_chat_template(messages, chat_template=name, tokenize=False)
        assert got == expected, name


@pytest.mark.parametrize("names, hf_shapes, shapes", [
    (("fuse_qkv",), [(8, 3), (4, 3), (4, 3)], GQA),
    (("fuse_qkv",), [(8,), (4,), (4,)], GQA),  # biases
    (("fuse_gate_up",), [(6, 3), (6, 3)], GQA),
    (("pad_vocab",), [(5, 3)], GQA),
    (("fuse_stacked_qkv",), [(6, 3)], Shapes(num_attention_heads=2, num_query_groups=2, kv_channels=1,
                                               vocab_size=1, padded_vocab_size=1)),
])
def test_rows_read_where_they_belong_equal_the_transforms(tmp_path, names, hf_shapes, shapes):
    """hf-to-megatron reads a row-moving rule's rows straight into place (row_runs, HFReader.read_runs); the result
    must be the transforms' own, bit for bit, zero padding included."""
    from safetensors.torch import save_file

    from megatron_patch.convert.hf_io import HFReader
    from megatron_patch.convert.transforms import row_runs

    tensors = {f"t{i}": torch.randn(shape).bfloat16() for i, shape in enumerate(hf_shapes)}
    save_file(tensors, tmp_path / "model.safetensors")
    [expected] = apply_to_mcore(names, list(tensors.values()), shapes)
    runs = row_runs(names, tuple(hf_shapes), shapes)
    assert torch.equal(HFReader(str(tmp_path)).read_runs(list(tensors), runs, expected.shape), expected)
    assert row_runs(("transpose",) + names, tuple(hf_shapes), shapes) is None  # columns move: read whole


def test_read_ahead_makes_every_tensor_once_and_leaves_errors_to_the_caller():
    """hf-to-megatron's helper thread reads ahead of the writer: whether the helper or the caller makes a tensor,
    each is made exactly once and taken as made, within the byte budget; a failure is met by the caller."""
    import threading

    from megatron_patch.convert.core import _ReadAhead
    from megatron_patch.model.conversion import Rule

    rules = [Rule((f"hf{i}",), f"m{i}") for i in range(40)]
    made, lock, held = [], threading.Lock(), []

    def make(r):
        with lock:
            made.append(r.mcore)
        if r.mcore == "m30":
            raise OSError("damaged file")
        return torch.full((4,), int(r.mcore[1:]))

    ahead = _ReadAhead(make, rules, nbytes=lambda r: 16, budget=64)
    try:
        for r in rules[:30]:
            tensor = ahead.take(r.mcore)
            held.append(ahead._held)
            assert torch.equal(tensor if tensor is not None else make(r), torch.full((4,), int(r.mcore[1:])))
        assert ahead.take("m30") is None  # the helper stopped at it
        with pytest.raises(OSError, match="damaged"):
            make(rules[30])
    finally:
        ahead.close()
    assert all(made.count(r.mcore) == 1 for r in rules[:30])  # by the helper or by the caller, never both
    assert max(held) <= 64
