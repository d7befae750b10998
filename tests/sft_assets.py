"""What the supervised fine-tuning tests share: a tiny chat tokenizer with Qwen2's ChatML template, conversations
of a few turns, the loss mask transformers gives them (each prefix rendered with ``apply_chat_template``, the
reference the prepared data must equal), and tiny Hugging Face chat models converted to megatron-core.

Example::

    tokenizer_dir = chat_tokenizer(data_assets(tmp_path_factory), str(tmp_path / "tokenizer"))
    ids, mask = reference_mask(AutoTokenizer.from_pretrained(tokenizer_dir), row["messages"])
"""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_patch.data.stand_ins import QWEN2_VOCAB
from megatron_patch.data.train_tokenizer import CHATML_TEMPLATE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The test tokenizer's 1000 tokens and ChatML's two fit this vocabulary, a multiple of 128 x TP 2: megatron-core pads
# nothing, so its softmax runs over the rows transformers' does and the losses compare exactly.
VOCAB = QWEN2_VOCAB


def chat_tokenizer(assets, directory: str) -> str:
    """The test HuggingFace tokenizer of ``assets`` (tests/conftest_data.py) with ChatML's special tokens and
    template, saved in ``directory``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets.options["HuggingFaceTokenizer"]["tokenizer_model"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def reference_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' rendering of ``messages`` and the mask of each assistant turn's tokens: those that
    rendering the turn adds after the messages before it and the generation prompt."""
    render = lambda part, prompt=False: tokenizer.apply_chat_template(  # noqa: E731
        part, tokenize=True, add_generation_prompt=prompt, return_dict=False)
    ids = render(messages)
    mask = [0] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] == "assistant":
            for position in range(len(render(messages[:turn], True)), len(render(messages[:turn + 1]))):
                mask[position] = 1
    return ids, mask


def converted_chat_model(kind: str, tokenizer_dir: str, root: str) -> dict:
    """A random Hugging Face ``kind`` ("llama", "qwen2" or "mixtral") with the chat tokenizer, and its megatron-core
    conversion (``megatron-patch convert hf-to-megatron``)."""
    import torch
    import transformers

    hf, converted = os.path.join(root, f"hf-{kind}"), os.path.join(root, f"mcore-{kind}")
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=64, **common))
    elif kind == "qwen2":  # LLaMA's layers with biases on q, k and v
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(intermediate_size=64, **common))
    else:
        # Router weights of std 0.2 keep the top-2 choice clear of near-ties (tests/convert_oracles.py). No
        # load-balancing loss: transformers' and megatron-core's differ, and the trainers compared train on the
        # models' own losses alone.
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
            router_aux_loss_coef=0.0, **common))
    model.save_pretrained(hf)
    transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(hf)
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", "convert", "hf-to-megatron", "--hf-dir", hf,
                           "--save-dir", converted], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {"hf": hf, "mcore": converted}


def hf_token_loss(hf_dir: str, conversations: list[tuple[list[int], list[int]]]) -> float:
    """transformers' loss over the trained tokens of ``conversations`` ((ids, mask) each, one at a time), weighted by
    token: the sum of each trained token's cross-entropy over their count."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    total, count = 0.0, 0.0
    for ids, mask in conversations:
        ids, mask = torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.float64)
        with torch.no_grad():
            logits = model(ids[None]).logits[0, :-1].double()
        losses = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
        total += float((losses * mask[1:]).sum())
        count += float(mask[1:].sum())
    return total / count
