"""Bad input gives an error naming the tensor and both shapes, and leaves nothing under the final name;
verify fails on corrupted weights and on the post-LN -> pre-LN BERT trap, refuses a directory of another model
at once, and works on a trainer's checkpoint; the command line reports each error as one line; a killed conversion's
files are gone once the next has run."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

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
    from megatron_patch.checkpoint.format import full_state_dict, read_info, write_info
    from megatron_patch.checkpoint.load import load_into_reference_model
    from megatron_patch.checkpoint.torch_dist import save_dist
    from megatron_patch.convert.core import build_reference_model

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
    save_dist(model, os.path.join(out_dir, "release"), info)
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


# ----------------------------------------------------------------------------------------------------------
# Through the command line: one line naming the file and the fix, nothing left under a final name
# ----------------------------------------------------------------------------------------------------------


def megatron_patch(*argv, timeout=300):
    """``megatron-patch ARGV`` in a subprocess: (exit status, stdout, stderr, seconds)."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


def assert_one_line_error(stderr, *fragments, prog="megatron-patch convert"):
    """stderr ends in the command's one-line error naming every fragment, with no traceback before it."""
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), stderr
    assert all(f in last for f in fragments), last
    assert "Traceback" not in stderr, stderr


def tree_bytes(root):
    """Every file under ``root``: relative path -> contents."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                files[os.path.relpath(os.path.join(folder, name), root)] = f.read()
    return files


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A tiny LLaMA and its torch_dist conversion (the CLI's, unverified: test_convert.py verifies it)."""
    root = tmp_path_factory.mktemp("cli")
    hf, ckpt = make_hf_model("llama-gqa", str(root / "llama-hf")), str(root / "llama-mcore")
    status, _, err, _ = megatron_patch("convert", "hf-to-megatron", "--hf-dir", hf, "--save-dir", ckpt, "--no-verify",
                                       "--no-progress")
    assert status == 0, err
    return root, hf, ckpt


@pytest.mark.parametrize("name,overrides,fields", [
    ("gpt2", {}, ["model_type gpt2 vs llama", "architecture GPT2LMHeadModel vs LlamaForCausalLM"]),
    ("llama-gqa", {"hidden_size": 64}, ["hidden_size 64 vs 32"]),
], ids=["gpt2-dir-llama-checkpoint", "llama-dir-of-another-width"])
def test_verify_refuses_another_models_directory_at_once(llama_checkpoint, name, overrides, fields):
    root, _, ckpt = llama_checkpoint
    hf = make_hf_model(name, str(root / f"{name}-{len(overrides)}-hf"), **overrides)
    status, _, err, seconds = megatron_patch("convert", "verify", "--hf-dir", hf, "--megatron-dir", ckpt)
    assert status == 1
    assert_one_line_error(err, f"--hf-dir {hf}", f"--megatron-dir {ckpt}", *fields)
    # From the two config files alone, before any model is built (it took 107 s and 16.8 GB to fail before).
    assert seconds < 60, seconds


def test_a_damaged_checkpoint_description_is_one_line(llama_checkpoint, tmp_path):
    _, hf, ckpt = llama_checkpoint
    damaged, out = str(tmp_path / "damaged"), str(tmp_path / "out")
    shutil.copytree(ckpt, damaged)
    args_file = os.path.join(damaged, "megatron_patch_args.json")
    cases = [('{"format": "torch_dist", "model_config": {"num_la', ["not valid JSON", "line 1"]),
             ('{"format": "torch_dist"}', ["not a description of a checkpoint", "model_config"])]
    for text, fragments in cases:
        with open(args_file, "w") as f:
            f.write(text)
        for argv in (["convert", "megatron-to-hf", "--load-dir", damaged, "--save-dir", out],
                     ["convert", "verify", "--hf-dir", hf, "--megatron-dir", damaged],
                     ["train", "--task", "pretraining", "--nproc-per-node", "1", "--load", damaged, "--mock-data",
                      "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1"]):
            status, _, err, _ = megatron_patch(*argv)
            assert status == 1
            prog = "rapidformer" if argv[0] == "train" else "megatron-patch convert"
            assert_one_line_error(err, args_file, *fragments, "restore megatron_patch_args.json", prog=prog)
    assert not os.path.exists(out)


@pytest.mark.parametrize("flags", [[], ["--apply-layernorm-1p"]], ids=["gamma", "gamma-minus-one"])
def test_verify_compares_a_trainer_checkpoint_with_its_export(tmp_path, flags):
    """The quick start's steps: train from scratch, export, and then verify the export against the checkpoint.
    With --apply-layernorm-1p the norms keep gamma - 1, which the export turns back into Hugging Face's gamma."""
    save, exported = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    status, out, err, _ = megatron_patch(
        "train", "--task", "pretraining", "--nproc-per-node", "1", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "99", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
        "4", "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--save", save, *flags)
    assert status == 0, out + err
    status, _, err, _ = megatron_patch("convert", "megatron-to-hf", "--load-dir", save, "--save-dir", exported,
                                       "--model-type", "gpt2", "--no-progress")
    assert status == 0, err
    # The command's own module as __main__, with a handler the interpreter's teardown would run: the verification
    # ran gloo collectives in this process, and after those a normal exit sometimes aborted (SIGABRT), failing a
    # passed verification (docs/megatron-core-on-cpu.md, item 11).
    probe = ("import atexit, runpy; atexit.register(print, 'interpreter teardown'); "
             "runpy.run_module('megatron_patch.cli', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", probe, "convert", "verify", "--hf-dir", exported, "--megatron-dir",
                           save], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "interpreter teardown" not in done.stdout, done.stdout + done.stderr
    assert done.stdout.strip().startswith("logits: ") and done.stdout.strip().endswith("PASS"), done.stdout


def test_conversion_errors_are_one_line_with_the_traceback_only_under_debug(tmp_path):
    missing = make_hf_model("llama-gqa", str(tmp_path / "missing-hf"))
    _edit_tensors(missing, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    foreign = make_hf_model("llama-gqa", str(tmp_path / "foreign-hf"))
    with open(os.path.join(foreign, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(foreign, "config.json"), "w") as f:
        json.dump({**config, "model_type": "t5"}, f)
    out = str(tmp_path / "out")
    for hf, fragments in ((missing, ["missing tensor model.layers.1.self_attn.k_proj.weight"]),
                          (foreign, ["model_type 't5'", "supported model types"])):
        argv = ["convert", "hf-to-megatron", "--hf-dir", hf, "--save-dir", out, "--no-progress"]
        status, _, err, _ = megatron_patch(*argv)
        assert status == 1
        assert_one_line_error(err, hf, *fragments)
    status, _, err, _ = megatron_patch("--debug", *argv)
    assert status == 1 and "Traceback" in err, err
    assert err.strip().splitlines()[-1].startswith("megatron-patch convert: error: "), err
    assert not os.path.exists(out)


def test_a_conversion_that_fails_verification_leaves_nothing_and_keeps_the_previous(llama_checkpoint, tmp_path):
    _, _, ckpt = llama_checkpoint
    hf = make_hf_model("llama-gqa", str(tmp_path / "nan-hf"))
    _edit_tensors(hf, lambda t: t["model.layers.1.mlp.down_proj.weight"].__setitem__((0, 0), float("nan")))
    fresh, previous = str(tmp_path / "fresh"), str(tmp_path / "previous")
    shutil.copytree(ckpt, previous)
    before = tree_bytes(previous)
    for save_dir, extra in ((fresh, []), (previous, ["--overwrite"])):
        status, out, err, _ = megatron_patch("convert", "hf-to-megatron", "--hf-dir", hf, "--save-dir", save_dir,
                                             "--no-progress", *extra)
        assert status == 1 and "FAIL" in out, out + err
        assert_one_line_error(err, hf, f"nothing was written to {save_dir}")
    assert sorted(os.listdir(tmp_path)) == ["nan-hf", "previous"]  # no fresh/, no temporary sibling
    assert tree_bytes(previous) == before


def _staging_dirs(root):
    return {name for name in os.listdir(root) if ".partial-" in name}


def _start_conversion(hf, save_dir, *flags):
    return subprocess.Popen([sys.executable, "-m", "megatron_patch.cli", "convert", "hf-to-megatron", "--hf-dir", hf,
                             "--save-dir", save_dir, "--no-progress", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_new_staging(process, root, known, timeout=120):
    """The staging directory ``process`` writes into, once it holds a file (the conversion is under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        for name in _staging_dirs(root) - known:
            with contextlib.suppress(FileNotFoundError):
                if os.listdir(os.path.join(root, name)):
                    return name
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"no staging directory appeared in {root} within {timeout} s")


def test_a_killed_conversion_leaves_nothing_once_the_next_has_run(tmp_path):
    """Failed before: a SIGKILL (the out-of-memory killer) runs no cleanup, and SIGTERM's default action ran none
    either, so each left ``SAVE.partial-<pid>``, as large as the model, which no later conversion removed."""
    hf = make_hf_model("llama-gqa", str(tmp_path / "hf"))
    save = str(tmp_path / "out")
    killed = _start_conversion(hf, save)
    left = _wait_for_new_staging(killed, tmp_path, set())
    killed.kill()
    killed.communicate(timeout=60)
    assert _staging_dirs(tmp_path) == {left}  # nothing can clean up after a SIGKILL

    stopped = _start_conversion(hf, save)
    _wait_for_new_staging(stopped, tmp_path, {left})
    stopped.terminate()
    _, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 128 + signal.SIGTERM, err
    assert f"removed {tmp_path / left}, left by process" in err, err
    assert sorted(os.listdir(tmp_path)) == ["hf"], "the final name or a staging directory was left"


def test_a_sigterm_a_library_turns_into_its_own_error_still_ends_the_command_with_143():
    """A SIGTERM that lands while torch.distributed.checkpoint plans a save: its collectives catch every exception,
    the SystemExit of ``unwind_on_sigterm`` too, and raise a CheckpointException instead, so the killed conversion
    above once ended with status 1 (seen in CI). A later command's own error is its own again."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from megatron_patch.errors import one_line_errors, unwind_on_sigterm

    @one_line_errors("megatron-patch convert")
    def stopped_while_saving() -> int:
        unwind_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)  # the handler runs here
        except BaseException as error:  # as torch/distributed/checkpoint/utils.py's reduce_scatter does
            raise CheckpointException("plan", {0: _wrap_exception(error)}) from None
        return 0

    @one_line_errors("megatron-patch convert")
    def broken() -> int:
        raise CheckpointException("plan", {0: _wrap_exception(RuntimeError("a real failure"))})

    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert stopped_while_saving() == 128 + signal.SIGTERM
        with pytest.raises(CheckpointException, match="a real failure"):
            broken()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_previous_checkpoint_moved_aside_by_a_killed_conversion_is_restored(tmp_path):
    """The instant between moving ``--overwrite``'s previous checkpoint aside and renaming the new one into place:
    killed there, the next conversion finds no checkpoint under the name, and the previous one comes back."""
    import socket

    from megatron_patch.convert.core import remove_killed_staging

    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process now
    host = socket.gethostname()
    final = tmp_path / "ckpt"
    aside, partial = tmp_path / f"ckpt.old-{host}-{dead.pid}", tmp_path / f"ckpt.partial-{host}-{dead.pid}"
    running = tmp_path / f"ckpt.partial-{host}-{os.getpid()}"
    other_host = tmp_path / f"ckpt.partial-{host}x-{dead.pid}"
    for folder in (aside, partial, running, other_host):
        folder.mkdir()
        (folder / "file").write_text(folder.name)
    remove_killed_staging(str(final))
    assert (final / "file").read_text() == aside.name
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", running.name, other_host.name])


def _ranks_started(pid):
    """Whether process ``pid`` has started the ranks of ``convert verify``."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            if "verify" in child.cmdline():
                return True
    return False


def test_a_conversion_stopped_while_its_ranks_verify_leaves_nothing(tmp_path):
    """Failed before: at TP=2 the verification runs on torchrun ranks, which the SIGTERM reached and ended; the
    conversion then reported a failed verification ("check the Hugging Face weights (NaN or inf?)"), status 1."""
    hf = make_hf_model("llama-gqa", str(tmp_path / "hf"))
    process = _start_conversion(hf, str(tmp_path / "out"), "--target-tensor-parallel-size", "2")
    deadline = time.monotonic() + 120
    while not _ranks_started(process.pid):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    process.terminate()
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "rapidformer: stopped by signal 15" in err and "verification" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("argv, message", [
    (["hf-to-megatron", "--hf-dir", "{hf}", "--save-dir", "{out}", "--target-tensor-parallel-size", "3"],
     "--num-attention-heads 4 is not divisible by --target-tensor-parallel-size 3"),
    (["hf-to-megatron", "--hf-dir", "{hf}", "--save-dir", "{out}", "--ckpt-format", "torch",
      "--target-pipeline-parallel-size", "3"], "--num-layers 4 is not divisible by --target-pipeline-parallel-size 3"),
    (["verify", "--hf-dir", "{hf}", "--megatron-dir", "{ckpt}", "--tensor-model-parallel-size", "3"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
], ids=["hf-to-megatron-tp", "hf-to-megatron-pp", "verify-tp"])
def test_a_layout_the_model_cannot_take_is_refused_before_any_work(llama_checkpoint, tmp_path, argv, message):
    """Failed before: hf-to-megatron read and wrote every weight, then each rank of its verification printed the
    error and the command blamed the weights ("verification ... failed ... NaN or inf?"), or the per-rank writer
    raised a traceback; verify started its ranks, each failing alone."""
    _, hf, ckpt = llama_checkpoint
    out = str(tmp_path / "out")
    status, stdout, err, _ = megatron_patch("convert", *(word.format(hf=hf, ckpt=ckpt, out=out) for word in argv))
    assert status == 1
    assert_one_line_error(err, message)
    assert "torch.distributed.run" not in stdout + err
    assert not os.listdir(tmp_path)  # neither the output nor a staging directory
