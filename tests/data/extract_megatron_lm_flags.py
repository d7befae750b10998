"""Regenerate megatron_lm_example_flags.json: the argv each Megatron-LM examples/ launch script passes to its
training program, taken by running the script with ``torchrun`` replaced by a function that prints its arguments.

Example::

    python tests/data/extract_megatron_lm_flags.py /path/to/Megatron-LM core_v0.16.1 \\
        > tests/data/megatron_lm_example_flags.json

Each script runs in an empty temporary directory (it creates its checkpoint and cache folders there) with
placeholder positional arguments (its own path shows as ``$PWD``); torchrun's own flags and the program's name
are dropped.
"""

import json
import os
import subprocess
import sys
import tempfile

# script -> (positional arguments, variant name); the llama script picks mock or real data by its arguments.
SCRIPTS = {
    "examples/llama/train_llama3_8b_h100_fp8.sh": [
        ([], "mock data"), (["CKPT", "TB", "TOKENIZER", "DATA_text_document"], "real data")],
    "examples/gpt3/train_gpt3_175b_distributed.sh": [
        (["CKPT", "TB", "gpt2-vocab.json", "gpt2-merges.txt", "DATA_text_document"], "as shipped")],
    "examples/bert/train_bert_340m_distributed.sh": [
        (["CKPT", "TB", "bert-vocab.txt", "DATA_text_sentence"], "as shipped")],
}
PRINT_TORCHRUN = 'torchrun() { printf "%s\\n" "$@"; }; export -f torchrun; '


def program_argv(text: str, positional: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as work:
        for program in ("pretrain_gpt.py", "pretrain_bert.py"):
            open(os.path.join(work, program), "w").close()
        out = subprocess.run(["bash", "-c", PRINT_TORCHRUN + 'bash -s "$@"', "bash", *positional], input=text,
                             capture_output=True, text=True, cwd=work, check=True).stdout.splitlines()
    program = next(i for i, word in enumerate(out) if word.endswith(".py"))
    return [word.replace(work, "$PWD") for word in out[program + 1:]]


def main(repo: str, tag: str) -> None:
    scripts = {}
    for path, variants in SCRIPTS.items():
        text = subprocess.run(["git", "--git-dir", repo, "show", f"{tag}:{path}"], capture_output=True, text=True,
                              check=True).stdout
        scripts[path] = {name: program_argv(text, positional) for positional, name in variants}
    json.dump({"source": "https://github.com/NVIDIA/Megatron-LM", "tag": tag, "scripts": scripts}, sys.stdout,
              indent=1)
    print()


if __name__ == "__main__":
    main(*sys.argv[1:])
