"""The README's commands are the ones that run: its set-up commands are CI's, and every other command block runs,
in order, as written (tests/test_quickstart.py runs the quick start)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def readme_commands() -> list[str]:
    return [line for line in readme_blocks()[0].splitlines() if line.strip()]


def test_readme_opens_with_two_commands():
    quickstart, tests = readme_commands()
    assert quickstart.endswith("megatron-patch quickstart")
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    """As the README writes it, ending CI when any of its steps fails (under set -e, only its last one would)."""
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_commands()[1] + " || exit $?" in ci_lines


def _losses(log_dir: Path) -> list[float]:
    with open(log_dir / "iterations.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def test_every_readme_command_runs_as_written(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for name in ("examples", "run_scripts"):  # "run them from the repository root"
        (work / name).symlink_to(ROOT / name)
    # "with the environment active": its bin/ first on PATH
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):  # the harness's own; a user has none
        env.pop(name, None)
    outputs = []
    for block in readme_blocks()[1:]:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True,
                              text=True, timeout=900)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"README block failed:\n{block}\n--- output ---\n{output[-6000:]}"
        outputs.append(output)
    everything = "\n".join(outputs)
    for run in ("gpt", "qwen2", "bert", "moe"):
        losses = _losses(work / "out" / run / "logs")
        assert sum(losses[-3:]) / 3 < losses[0], (run, losses)
    assert (work / "out" / "gpt" / "logs" / "loss_curves.png").is_file()
    assert re.search(r"routing of layer 1 at iteration \d+ \| load_balancing_loss: ", everything)  # the MoE run
    assert "per GPU" in everything.lower() or "gib" in everything.lower()  # the dry run's plan
    assert re.search(r"accuracy: [0-9.]+", everything)  # the classifier's epoch metrics
    assert "[[" in everything and "# conversation 1:" in everything  # --show marked the trained tokens
    blocks = readme_blocks()[1:]
    sft_output, dpo_output = (outputs[next(i for i, block in enumerate(blocks) if script in block)]
                              for script in ("run_finetune_gpt.sh", "run_dpo_gpt.sh"))
    sft = [float(loss) for loss in re.findall(r"epoch \d+ \| loss: ([0-9.]+)", sft_output)]
    assert len(sft) == 2 and sft[1] < sft[0], sft  # the SFT run's dev loss, after each epoch
    assert (work / "hf" / "qwen2-sft" / "config.json").is_file()
    # The DPO run: its dev metrics after each epoch, TRL's names, and the export of the tuned model.
    assert len(re.findall(r"epoch \d+ \| loss: [0-9.]+ \| rewards/chosen: ", dpo_output)) == 2, dpo_output[-3000:]
    assert "rewards/margins: " in dpo_output and (work / "hf" / "qwen2-dpo" / "config.json").is_file()
    assert "def main(" in outputs[-2]  # the export generated text from the prompt
    assert len(re.findall(r"accuracy: [0-9.]+", outputs[-1])) == 2  # the exported BERT fine-tuned, two epochs


def test_stand_ins_never_replace_what_exists(tmp_path):
    """The README's stand-ins beside a user's own inputs: each one that exists is named and left as it was."""
    mine = {"hf/qwen2/config.json": "{}", "data/glue/mrpc/train.tsv": "mine", "data/chat.jsonl": "{}\n",
            "data/prefs.jsonl": "{}\n", "llama2/tokenizer.model": "mine"}
    for name, text in mine.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def make_stand_ins(*flags):
        return subprocess.run([sys.executable, "-m", "megatron_patch.cli", "make-stand-ins", "--output-dir",
                               str(tmp_path), *flags], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))

    done = make_stand_ins()
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("kept ") == 5 and "wrote" not in done.stdout, done.stdout
    assert {name: (tmp_path / name).read_text() for name in mine} == mine
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["chat.jsonl", "glue", "prefs.jsonl"]
    missing = str(tmp_path / "none.jsonl")
    done = make_stand_ins("--corpus", missing)
    assert done.returncode == 2 and f"--corpus {missing}: no such file" in done.stderr, done.stderr


def test_what_a_killed_make_stand_ins_left_the_next_run_removes(tmp_path):
    """A stand-in half-written by a process that is gone (its staging name, staging.py's) goes when the next run
    writes that stand-in; the others, already there, are kept."""
    from megatron_patch.staging import staging_tag

    for name in ("hf/qwen2", "data/glue/mrpc", "data/chat.jsonl", "llama2"):
        (tmp_path / name).mkdir(parents=True) if "." not in name else (tmp_path / name).write_text("{}\n")
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process now
    leftover = tmp_path / "data" / ("prefs.jsonl" + staging_tag("partial").replace(str(os.getpid()), str(dead.pid)))
    leftover.write_text("half")
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", "make-stand-ins", "--output-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("kept ") == 4 and done.stdout.count("wrote ") == 1, done.stdout
    assert not leftover.exists() and len((tmp_path / "data" / "prefs.jsonl").read_text().splitlines()) == 64
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["chat.jsonl", "glue", "prefs.jsonl"]
