"""Bad input gives an error naming the tensor and both shapes, and leaves nothing under the final name;
verify fails on corrupted weights and on the post-LN -> pre-LN BERT trap."""

import json
import os

import pytest

from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import cli, make_hf_model


def convert_expecting(rank, world_size, hf_dir, save_dir, overrides=None):
    """Run hf_to_megatron; return the error text (None when it succeeded)."""
    from megatron_patch import compat
    from megatron_patch.convert.core import hf_to_megatron

    compat.apply()
    try:
        hf_to_megatron(hf_dir, save_dir, progress=False, **(overrides or {}))
    except Exception as error:  # the test inspects the message
        return f"{type(error).__name__}: {error}"
    return None


def _edit_tensors(hf_dir, edit):
    from safetensors.torch import load_file, save_file

    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


def _fresh(root, name):
    return make_hf_model("llama-gqa", str(root / name))


def test_bad_inputs_name_the_problem(llama):
    import torch

    root = llama
    cases = {}
    hf = _fresh(root, "unsupported")
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "t5"
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f)
    cases["unsupported"] = (hf, ["model_type 't5'", "supported model types"])
    hf = _fresh(root, "missing")
    _edit_tensors(hf, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    cases["missing"] = (hf, ["missing tensor model.layers.1.self_attn.k_proj.weight"])
    hf = _fresh(root, "extra")
    _edit_tensors(hf, lambda t: t.update({"model.layers.9.mlp.extra.weight": torch.zeros(2, 2)}))
    cases["extra"] = (hf, ["unexpected tensor model.layers.9.mlp.extra.weight (2, 2)"])
    hf = _fresh(root, "shape")
    _edit_tensors(hf, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(40, 32)}))
    cases["shape"] = (hf, ["model.layers.2.mlp.up_proj.weight", "(40, 32)", "(48, 32)"])
    for label, (hf, fragments) in cases.items():
        save = str(root / f"{label}-out")
        [error] = run_on_ranks(convert_expecting, 1, args=(hf, save))
        assert error is not None, f"{label}: conversion did not fail"
        assert all(f in error for f in fragments), f"{label}: {error}"
        leftovers = [n for n in os.listdir(root) if n.startswith(f"{label}-out")]
        assert not leftovers, f"{label}: partial output left behind: {leftovers}"


def export_expecting(rank, world_size, load_dir, save_dir):
    from megatron_patch import compat
    from megatron_patch.convert.core import megatron_to_hf

    compat.apply()
    try:
        megatron_to_hf(load_dir, save_dir, progress=False)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    import shutil

    hf = make_hf_model("llama-gqa", str(tmp_path / "llama-hf"))
    gpt2 = make_hf_model("gpt2", str(tmp_path / "gpt2-hf"))
    a, b = str(tmp_path / "llama-m"), str(tmp_path / "gpt2-m")
    for src, dst in ((hf, a), (gpt2, b)):
        assert run_on_ranks(convert_expecting, 1, args=(src, dst)) == [None]
    # The weights of one model under the recorded arguments of the other.
    shutil.rmtree(os.path.join(a, "release"))
    shutil.copytree(os.path.join(b, "release"), os.path.join(a, "release"))
    [error] = run_on_ranks(export_expecting, 1, args=(a, str(tmp_path / "out")))
    assert error is not None and "CheckpointMismatch" in error
    for problem in ("decoder.layers.self_attention.linear_qkv.weight: checkpoint has shape (4, 96, 32), model "
                    "expects (4, 64, 32)", "output_layer.weight: missing from the checkpoint"):
        assert problem in error, error
    assert not os.path.exists(tmp_path / "out")


def corrupt_checkpoint(rank, world_size, megatron_dir, out_dir, pre_ln):
    """Re-save ``megatron_dir`` with one layer's weights perturbed, or (pre_ln) with post-LN BERT weights
    mapped by name into Megatron's pre-LN BERT, the conversion that runs without error and is wrong."""
    import dataclasses

    import torch

    from megatron_patch import compat
    from megatron_patch.convert.mcore_io import (
        build_reference_model, full_state_dict, load_into_reference_model, read_info, save_dist, write_info,
    )

    compat.apply()
    info = read_info(megatron_dir)
    model = build_reference_model(info.model_config, info.padded_vocab_size)
    load_into_reference_model(model, megatron_dir, info)
    full = full_state_dict(model)
    if pre_ln:
        info.model_config = dataclasses.replace(info.model_config, bert_layernorm_style="pre")
        model = build_reference_model(info.model_config, info.padded_vocab_size)
        renamed = {k.replace("post_attention_layernorm", "pre_mlp_layernorm")
                    .replace("post_mlp_layernorm", "input_layernorm"): v for k, v in full.items()}
        renamed["encoder.final_layernorm.weight"] = full["embedding.layer_norm.weight"]
        renamed["encoder.final_layernorm.bias"] = full["embedding.layer_norm.bias"]
        with torch.no_grad():
            for name, tensor in full_state_dict(model).items():
                tensor.copy_(renamed[name])
    else:
        with torch.no_grad():
            full["decoder.layers.1.mlp.linear_fc2.weight"].mul_(1.05)
    os.makedirs(out_dir)
    save_dist(model, os.path.join(out_dir, "release"))
    write_info(out_dir, info)


@pytest.mark.parametrize("name,pre_ln", [("llama-gqa", False), ("bert-pretraining", True)],
                         ids=["perturbed-weights", "bert-post-ln-into-pre-ln"])
def test_verify_fails_on_a_wrong_checkpoint(tmp_path, name, pre_ln):
    hf = make_hf_model(name, str(tmp_path / "hf"))
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", good, "--no-progress"],)) == [0]
    run_on_ranks(corrupt_checkpoint, 1, args=(good, bad, pre_ln))
    [status] = run_on_ranks(cli, 1, args=(["verify", "--hf-dir", hf, "--megatron-dir", bad],))
    assert status == 1
