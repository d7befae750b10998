"""The flags of Megatron-LM's and Pai-Megatron-Patch's launch scripts (tests/data/example_script_flags.json, made by
tests/data/collect_example_flags.py: Megatron-LM core_v0.19.0's GPT/BERT examples/ and Pai-Megatron-Patch's
examples/*/run_mcore_*.sh) are each accepted, logged as ignored with the reason, or refused in one line that says why
and what to use: none is an unrecognized argument.

Failed before: 136 of the 248 flags were unrecognized, among them --use-flash-attn, --no-rope-fusion,
--no-masked-softmax-fusion, --patch-tokenizer-type, --wandb-project and --log-params-norm.
"""

import json
import os

import pytest

from megatron_patch.model.config import layer_freq, parse_window_size
from megatron_patch.training.arguments import build_parser, parse_args, parse_flags
from megatron_patch.training.ignored_flags import IGNORED_FLAGS, REFUSED_FLAGS

DATA = json.load(open(os.path.join(os.path.dirname(__file__), "data", "example_script_flags.json")))
SCRIPTS = {f"{s['repo'].rsplit('/', 1)[1]}:{s['path']}": s["flags"] for s in DATA["scripts"]}
PARSER = build_parser()


def _argv(flags: list[str]) -> list[str]:
    """``flags`` with a value of the right kind after each that takes some (a choice, a number or a word)."""
    argv = []
    for name in flags:
        action = PARSER._option_string_actions[name]
        count = {None: 1, "?": 0, "*": 0, "+": 1}.get(action.nargs, action.nargs)
        value = (action.choices[0] if action.choices else "1" if action.type in (int, float, layer_freq)
                 else "4095,0" if action.type is parse_window_size else "x")
        argv += [name, *[str(value)] * count]
    return argv


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_the_script_is_accepted_or_refused_with_a_reason(script):
    flags = SCRIPTS[script]
    accepted = [f for f in flags if f in PARSER._option_string_actions]
    assert not set(flags) - set(accepted) - set(REFUSED_FLAGS), "neither accepted nor refused"
    parse_flags(_argv(accepted))  # the whole set in one command line: nothing unrecognized
    for name in set(flags) & set(REFUSED_FLAGS):
        with pytest.raises(SystemExit) as refused:
            parse_flags([name, "1"])
        message = str(refused.value)
        assert message == f"rapidformer: error: {name}: {REFUSED_FLAGS[name]}" and "\n" not in message


def test_collected_figures():
    flags = {f for script in SCRIPTS.values() for f in script}
    accepted = flags & set(PARSER._option_string_actions)
    assert len(SCRIPTS) == 35 and len(flags) == 248
    # Issue 41 accepts the 10 multi-latent attention flags, 6 router flags, --moe-layer-freq and the 2 multi-token
    # prediction flags (19 that were refused); issue 49 acts on --train-data-path and --valid-data-path (with --sft),
    # which were refused; issue 51 (Gemma 3) acts on --window-size, --window-attn-skip-freq and
    # --rotary-seq-len-interpolation-factor, which were refused.
    assert (len(accepted - set(IGNORED_FLAGS)), len(accepted & set(IGNORED_FLAGS)), len(flags - accepted)) == \
        (141, 36, 71)


def test_flags_the_issue_names_are_megatron_lm_s(tmp_path):
    """Megatron-LM's spelling (``--override-opt_param-scheduler``), each with its meaning or its notice."""
    args = parse_args(["--override-opt_param-scheduler", "--exit-interval", "5", "--log-params-norm",
                       "--use-flash-attn", "--no-rope-fusion", "--no-masked-softmax-fusion", "--wandb-project", "p",
                       "--wandb-exp-name", "run", "--wandb-save-dir", str(tmp_path), "--lr-warmup-init", "1e-5"])
    assert args.override_opt_param_scheduler and args.exit_interval == 5 and args.wandb_project == "p"
    assert args.lr_warmup_init == 1e-5
    ignored = {n.split(" ")[1] for n in args.flag_notices if n.startswith("ignored: ")}
    assert {"--log-params-norm", "--use-flash-attn", "--no-rope-fusion", "--no-masked-softmax-fusion"} <= ignored
    assert parse_args(["--use-checkpoint-opt_param-scheduler"]).use_checkpoint_opt_param_scheduler
    with pytest.raises(SystemExit, match="--patch-tokenizer-type: Pai-Megatron-Patch's tokenizer names: give "
                                         "--tokenizer-type HuggingFaceTokenizer"):
        parse_args(["--patch-tokenizer-type", "Qwen2Tokenizer"])
    with pytest.raises(SystemExit, match="--dataloader-type cyclic: samples come here in Megatron-LM's 'single'"):
        parse_args(["--dataloader-type", "cyclic"])


def test_exit_interval_saves_and_stops_through_the_cli(tmp_path):
    """Megatron-LM's --exit-interval: stop after the first iteration divisible by it, saving under --save."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "megatron_patch.cli", "train", "--task", "pretraining", "--mock-data", "--num-layers",
         "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--train-iters",
         "6", "--exit-interval", "2", "--save", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exiting at iteration 2 (--exit-interval 2), saved to {tmp_path}" in result.stdout
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
