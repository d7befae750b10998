"""Ctrl-C typed in a terminal during a recipe, or during any other command: the ranks save the iteration they are in
and the last line names it and the --load to resume with; a second Ctrl-C stops them at once. (A rapidformer command
without --exit-signal-handler stops where it is, saying what it left: test_run_reports.) Typed on a pseudo-terminal,
whose line discipline sends SIGINT to the whole foreground process group (the shell, the launcher and tee), as a
terminal does.

    python -m pytest -q -p no:cacheprovider tests/test_ctrl_c.py

Failed before: the recipe exited 130 with no line at all and no save (tee died on the SIGINT, so the launcher's
last lines went nowhere, and torchrun's handler stopped the ranks where they were).
"""

import os
import pty
import re
import select
import sys
import time

import pytest

from megatron_patch.checkpoint.format import read_tracker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt", "run_pretrain_gpt.sh")


def _type_ctrl_c(argv: list[str], env: dict, times: int, timeout: float = 240,
                 after: tuple[bytes, bytes] = (b" iteration 4/", b"rapidformer: Ctrl-C:")) -> tuple[int, str, float]:
    """Run ``argv`` on a pseudo-terminal, type Ctrl-C ``times`` times, once ``after[0]`` is printed, then once
    ``after[1]`` is (by default iteration 4's log line, then the launcher's answer to the first); (exit status,
    output, seconds from the first Ctrl-C to the exit)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        os.execvpe(argv[0], argv, env)
    output, typed, first, start = b"", 0, None, time.monotonic()
    while time.monotonic() - start < timeout:
        if select.select([fd], [], [], 1)[0]:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child side closed
                break
            if not data:
                break
            output += data
        waiting_for = after[min(typed, 1)]
        if typed < times and waiting_for in output:
            os.write(fd, b"\x03")
            typed += 1
            first = first or time.monotonic()
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace"), time.monotonic() - (first or start)


@pytest.fixture()
def recipe(tmp_path):
    from test_prelaunch import _write_prefix

    _write_prefix(str(tmp_path / "c_text_document"), 300)
    argv = ["bash", GPT, "--cpu", "--nproc-per-node", "2", "--tokenizer-type", "NullTokenizer", "--data-path",
            str(tmp_path / "c_text_document"), "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "100000", "--save-interval", "1000", "--output-dir", str(tmp_path / "out"), "--",
            "--vocab-size", "64", "--split", "90,10,0", "--log-interval", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return argv, env, tmp_path / "out" / "checkpoints"


def test_ctrl_c_saves_the_iteration_reached_and_names_the_resume(recipe):
    argv, env, checkpoints = recipe
    status, output, _ = _type_ctrl_c(argv, env, times=1)
    assert status == 130, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    saved = read_tracker(str(checkpoints))
    reached = max(int(i) for i in re.findall(r" iteration (\d+)/", output))
    assert saved == reached >= 4, (saved, reached, output[-3000:])
    assert lines[-1] == (f"rapidformer: stopped by Ctrl-C (SIGINT); the latest checkpoint is iteration {saved} in "
                         f"{checkpoints}: resume with --load {checkpoints}"), lines[-5:]
    assert "Traceback" not in output


def test_a_second_ctrl_c_stops_at_once(recipe):
    argv, env, _ = recipe
    status, output, seconds = _type_ctrl_c(argv, env, times=2)
    assert status == 130, output[-3000:]
    assert seconds < 10, seconds
    last = [line for line in output.splitlines() if line.strip()][-1]
    assert last.startswith("rapidformer: stopped by signal 2 (SIGINT)"), output[-3000:]



def test_ctrl_c_during_preprocessing_is_one_line_and_leaves_nothing(tmp_path):
    """Any command, here preprocess-data half-way through its input: status 130 and one line, no traceback from it
    or its workers, and no output file under a final or temporary name."""
    from megatron_patch.data.corpus import write_stdlib_corpus
    from megatron_patch.data.train_tokenizer import train_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    write_stdlib_corpus(str(corpus), max_docs=300)
    train_tokenizer("gpt2-bpe", str(corpus), str(tmp_path / "gpt2"), 500)
    corpus.write_text(corpus.read_text() * 8)  # about 50 MB: several seconds of work
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-m", "megatron_patch.cli", "preprocess-data", "--input", str(corpus), "--output-prefix",
            str(out / "corpus"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(tmp_path / "gpt2" / "vocab.json"),
            "--merge-file", str(tmp_path / "gpt2" / "merges.txt"), "--workers", "2"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    status, output, seconds = _type_ctrl_c(argv, env, times=1, timeout=120, after=(b"MB/s", b""))
    assert status == 130, output[-3000:]
    assert seconds < 10, seconds
    assert "Traceback" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == "megatron-patch preprocess-data: stopped by Ctrl-C (SIGINT)", \
        output[-500:]
    assert os.listdir(out) == []
