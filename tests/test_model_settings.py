"""Each ModelConfig field is declared once: its ``setting(...)`` beside the field gives its flag, its Megatron-LM
argument, whether megatron-core's TransformerConfig takes it as it is and whether it fixes the model's shape; the
flags, both directions of the Megatron-LM translation, TransformerConfig and the shape check are made from it. Only
translations that compute something (``activation`` is two switches and a function) are written by hand, once each.

Example::

    python -m pytest -q tests/test_model_settings.py

``declarations`` reads the source: for every field and every translation, the places that name it. A field named by
hand where its setting already translates it, or named twice by hand, fails the test and is listed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib

import pytest

from megatron_patch.model.config import SETTINGS, ModelConfig, add_model_arguments, get_model_config

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "megatron_patch"

# translation -> (file, the functions that write it by hand, naming a field or argument as a keyword; None: the file's
# module-level constants, naming fields as strings)
TRANSLATIONS = {
    "transformer": ("model/builder.py", ("to_transformer_config", "_expert_parallel_fields")),
    "megatron_lm read": ("checkpoint/format.py", ("info_from_megatron_lm",)),
    "megatron_lm write": ("checkpoint/format.py", ("megatron_lm_args",)),
    "shape": ("convert/core.py", None),
}


def _names_in(tree: ast.AST, functions: tuple[str, ...] | None) -> dict[str, set[str]]:
    """where -> the names written there: keywords in ``functions``, or strings in module-level assignments."""
    if functions is None:
        return {"module": {n.value for stmt in tree.body if isinstance(stmt, ast.Assign) for n in ast.walk(stmt)
                           if isinstance(n, ast.Constant) and isinstance(n.value, str)}}
    return {node.name: {k.arg for k in ast.walk(node) if isinstance(k, ast.keyword) and k.arg}
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in functions}


def _flags_added_by_hand(sources: dict[str, str]) -> dict[str, list[str]]:
    """Flags each file gives ``add_argument`` as string literals."""
    found = {}
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                found.setdefault(path, []).extend(a.value for a in node.args if isinstance(a, ast.Constant))
    return found


def declarations(sources: dict[str, str]) -> dict[str, dict[str, list[str]]]:
    """field -> translation -> where it is declared: ``ModelConfig.<field>`` for its setting, ``file:function``
    for a hand-written one (``sources``: the package's files by path under megatron_patch/)."""
    table = {name: {t: [] for t in ("flag", *TRANSLATIONS)} for name in SETTINGS}
    for s in SETTINGS.values():
        here = f"ModelConfig.{s.name}"
        for translation, declared in (("flag", s.flag or s.switches), ("transformer", s.transformer),
                                      ("megatron_lm read", s.megatron_lm), ("megatron_lm write", s.megatron_lm),
                                      ("shape", s.shape)):
            if declared:
                table[s.name][translation].append(here)
    for path, flags in _flags_added_by_hand(sources).items():
        for s in SETTINGS.values():
            if {s.flag, *s.switches} & set(flags):
                table[s.name]["flag"].append(path)
    for translation, (path, functions) in TRANSLATIONS.items():
        for where, names in _names_in(ast.parse(sources[path]), functions).items():
            for s in SETTINGS.values():
                # A read names the field (ModelConfig's keyword), a write Megatron-LM's argument too.
                spelled = {s.name} | (set(s.megatron_lm) if translation == "megatron_lm write" else set())
                if spelled & names:
                    table[s.name][translation].append(f"{path}:{where}")
    return table


def _package_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_every_field_is_declared_once_in_each_translation():
    table = declarations(_package_sources())
    twice = {name: {t: where for t, where in row.items() if len(where) > 1} for name, row in table.items()}
    twice = {name: row for name, row in twice.items() if row}
    listing = "\n".join(f"{name}: " + "; ".join(f"{t} in {', '.join(w)}" for t, w in row.items() if w)
                        for name, row in table.items())
    assert not twice, f"declared more than once: {twice}\n{listing}"
    assert set(table) == {f.name for f in dataclasses.fields(ModelConfig)}
    # The translations computed by hand are these, and each is somewhere (the listing is not empty by accident).
    by_hand = {(name, t) for name, row in table.items() for t, where in row.items()
               if where and not where[0].startswith("ModelConfig.")}
    assert by_hand == {
        ("num_query_groups", "megatron_lm read"), ("num_query_groups", "megatron_lm write"),
        ("max_position_embeddings", "megatron_lm read"), ("max_position_embeddings", "megatron_lm write"),
        ("position_embedding_type", "megatron_lm read"), ("position_embedding_type", "megatron_lm write"),
        ("activation", "megatron_lm read"), ("family", "megatron_lm read"), ("vocab_size", "megatron_lm read"),
        ("vocab_size", "megatron_lm write"), ("rotary_base", "transformer"),
        ("num_tokentypes", "megatron_lm read"), ("num_tokentypes", "megatron_lm write"),
        ("add_binary_head", "megatron_lm read"), ("bert_layernorm_style", "megatron_lm read"),
    }, listing


@pytest.mark.parametrize("path, function, injected", [
    ("model/builder.py", "to_transformer_config", "q_lora_rank=m.q_lora_rank"),
    ("checkpoint/format.py", "megatron_lm_args", "norm_epsilon=m.layernorm_epsilon"),
])
def test_a_field_written_by_hand_beside_its_setting_is_seen(path, function, injected):
    sources = _package_sources()
    before = {"model/builder.py": "        gated_linear_unit=m.gated_mlp,\n",
              "checkpoint/format.py": "        megatron_patch=json.dumps(info.to_json()),\n"}[path]
    assert sources[path].count(before) == 1
    sources[path] = sources[path].replace(before, f"        {injected},\n{before}")
    field = {"q_lora_rank": "q_lora_rank", "norm_epsilon": "layernorm_epsilon"}[injected.split("=")[0]]
    translation = "transformer" if path == "model/builder.py" else "megatron_lm write"
    assert declarations(sources)[field][translation] == [f"ModelConfig.{field}", f"{path}:{function}"]


def test_a_flag_added_by_hand_is_seen():
    sources = {**_package_sources(), "extra.py": "parser.add_argument('--kv-lora-rank', type=int)\n"}
    assert declarations(sources)["kv_lora_rank"]["flag"] == ["ModelConfig.kv_lora_rank", "extra.py"]


def test_the_flags_come_from_the_settings():
    parser = add_model_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--model-name", "tiny-deepseek-v3", "--rope-type", "rope", "--beta-fast", "16",
                              "--num-experts", "8", "--moe-layer-freq", "([0]*1+[1]*3)", "--norm-epsilon", "1e-6",
                              "--openai-gelu"])
    assert (args.rope_type, args.beta_fast, args.num_moe_experts, args.moe_layer_freq, args.layernorm_epsilon,
            args.openai_gelu) == ("rope", 16.0, 8, [0, 1, 1, 1], 1e-6, True)
    with pytest.raises(SystemExit):  # a Literal's values are the flag's choices
        parser.parse_args(["--moe-token-drop-policy", "random"])


def test_megatron_lm_args_read_back_into_the_same_model():
    from megatron_patch.checkpoint.format import CheckpointInfo, info_from_megatron_lm, megatron_lm_args

    for name in ("tiny-llama", "tiny-qwen2-moe", "tiny-deepseek-v3", "tiny-gpt2"):
        model = get_model_config(name)
        info = CheckpointInfo(format="torch_dist", model_config=model, padded_vocab_size=128, dtype="float32")
        state = {"args": megatron_lm_args(info), "checkpoint_version": 3.0}
        # Megatron-LM's args hold the positions a model has (None here: seq_length's).
        expected = dataclasses.replace(model, max_position_embeddings=model.max_positions)
        assert info_from_megatron_lm(state, "torch_dist", "nowhere/common.pt").model_config == expected, name
