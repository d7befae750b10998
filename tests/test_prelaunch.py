"""A user's mistakes refused by the launcher in one line, before any rank starts: a ``--load`` directory that does
not exist, a ``--data-path`` naming a data file or preprocess's ``--output-prefix``, a ``--split`` that leaves a
split asked for samples empty (a changed schedule on resume: tests/test_lr_schedule_resume.py).

    python -m pytest -q -p no:cacheprovider tests/test_prelaunch.py

Failed before: the missing ``--load`` trained random weights and exited 0; the others were said by every rank after
the ~210-line arguments block (``.bin.bin not found``, a traceback for the empty split), 8 to 17 s in.
"""

import os
import struct

import numpy
import pytest

from megatron_patch.training import launcher

TINY = ["--task", "pretraining", "--nproc-per-node", "1", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--train-iters", "2"]


def _write_prefix(prefix: str, sequences: int, length: int = 20) -> None:
    """``sequences`` documents of ``length`` uint16 tokens in megatron-core's .bin/.idx (version 1, dtype code 8)."""
    numpy.arange(sequences * length, dtype=numpy.uint16).__imod__(64).tofile(prefix + ".bin")
    with open(prefix + ".idx", "wb") as f:
        f.write(struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, sequences, sequences + 1))
        f.write(numpy.full(sequences, length, numpy.int32).tobytes())
        f.write((numpy.arange(sequences, dtype=numpy.int64) * length * 2).tobytes())
        f.write(numpy.arange(sequences + 1, dtype=numpy.int64).tobytes())


@pytest.fixture()
def data(tmp_path, monkeypatch):
    """A 300-sequence prefix as preprocess-data names it (``--output-prefix data/c``), the directory current."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("data")
    _write_prefix("data/c_text_document", 300)
    return "data/c_text_document"


def _refused(argv, capsys, monkeypatch) -> str:
    """The launcher's refusal of ``argv``: every line it printed, the last one its error; no rank may start."""
    def started(*_, **__):
        raise AssertionError("a rank started")

    monkeypatch.setattr(launcher, "run_torchrun", started)
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(argv)
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines() + str(exit_info.value.code).splitlines()
    assert len(lines) <= 3, lines
    assert "Traceback" not in "\n".join(lines)
    return lines[-1]


@pytest.mark.parametrize("given, message", [
    ("data/c_text_document.bin", "--data-path data/c_text_document.bin names a data file; give its prefix, "
                                 "without .bin: --data-path data/c_text_document"),
    ("data/c_text_document.idx", "without .idx: --data-path data/c_text_document"),
    ("data/c", "data/c.bin not found but data/c_text_document.bin is (preprocess-data adds _text_document to its "
               "--output-prefix): give --data-path data/c_text_document"),
])
def test_a_data_file_or_output_prefix_names_the_prefix_to_give(data, capsys, monkeypatch, given, message):
    assert message in _refused([*TINY, "--split", "90,10,0", "--data-path", given], capsys, monkeypatch)


def test_a_missing_load_directory_is_refused_unless_it_is_save(data, capsys, monkeypatch):
    line = _refused([*TINY, "--split", "90,10,0", "--data-path", data, "--load", "out/gtp/checkpoints"], capsys,
                    monkeypatch)
    assert line.startswith("rapidformer: error: --load out/gtp/checkpoints: no such directory"), line
    # The first run of a job that resumes or starts: --load and --save the same directory.
    command = launcher.launch_command([*TINY, "--split", "90,10,0", "--data-path", data, "--load", "ckpt", "--save",
                                       "ckpt"])
    assert "torch.distributed.run" in command


def test_a_split_left_empty_is_refused_from_the_index_headers(data, capsys, monkeypatch):
    # The default 969,30,1 on 300 sequences: the test split's share rounds to none of them.
    line = _refused([*TINY, "--data-path", data], capsys, monkeypatch)
    assert ("--split 969,30,1 leaves the test split of data/c_text_document empty (300 sequences) but 20 test "
            "samples are asked for") in line, line
    assert "torch.distributed.run" in launcher.launch_command([*TINY, "--data-path", data, "--split", "90,5,5"])
    assert "torch.distributed.run" in launcher.launch_command([*TINY, "--data-path", data, "--eval-iters", "0"])


def test_a_hugging_face_load_is_refused_for_a_task_and_passed_to_a_user_script(data, capsys, monkeypatch):
    os.mkdir("hf")
    with open("hf/config.json", "w") as f:
        f.write("{}")
    line = _refused([*TINY, "--split", "90,10,0", "--data-path", data, "--load", "hf"], capsys, monkeypatch)
    assert "--load hf holds a Hugging Face model (config.json), not a Megatron checkpoint" in line, line
    with open("finetuner.py", "w") as f:
        f.write("")
    user = ["--user-script", "finetuner.py", "--nproc-per-node", "1", "--pretrained-model-name-or-path", "hf",
            "--micro-batch-size", "2", "--epochs", "1"]
    assert "torch.distributed.run" in launcher.launch_command([*user, "--load", "hf"])
