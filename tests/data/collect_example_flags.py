"""Regenerate example_script_flags.json: every ``--flag`` the training launch scripts of Megatron-LM's examples/ and
Pai-Megatron-Patch's ``examples/*/run_mcore_*.sh`` recipes name, script by script.

Example::

    python tests/data/collect_example_flags.py /work/.mirror/NVIDIA+Megatron-LM/repo core_v0.19.0 \\
        /work/.mirror/alibaba+Pai-Megatron-Patch/repo HEAD > tests/data/example_script_flags.json

The flags are grepped (``--[A-Za-z0-9][A-Za-z0-9_-]*``) from each script's text, so every branch of a recipe counts
(Pai-Megatron-Patch's pick flags by their positional arguments). The flags of the programs around the training one
(torchrun, srun/sbatch, nsys, ray, hydra) and a script's own options are listed apart, with whose they are.
"""

import json
import re
import subprocess
import sys

MEGATRON_LM_SCRIPTS = [  # GPT/BERT-family training (pretrain_gpt.py, pretrain_bert.py); T5, Mamba and the
    # multimodal examples run other programs.
    "examples/bert/train_bert_340m_distributed.sh",
    "examples/gpt3/train_gpt3_175b_distributed.sh",
    "examples/llama/train_llama3_8b_h100_fp8.sh",
    "examples/mixtral/train_mixtral_8x7b_distributed.sh",
    "examples/gptoss/02_train.sh",
    "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh",
    "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh",
]
NOT_PROGRAM_FLAGS = {
    **dict.fromkeys(["--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"], "torchrun"),
    **dict.fromkeys(["--container-image", "--container-mounts", "--container-workdir", "--exclusive", "--gres",
                     "--job-name", "--nodes", "--ntasks-per-node", "--partition", "--time", "--dependency", "--mpi",
                     "--account"],
                    "srun/sbatch"),
    **dict.fromkeys(["--capture-range", "--capture-range-end", "--cpuctxsw", "--cuda-graph-trace",
                     "--cuda-memory-usage", "--sample", "--trace"], "nsys profile"),
    **dict.fromkeys(["--head", "--block", "--port", "--address"], "ray start (Pai-Megatron-Patch's *_verl.sh)"),
    "--config-file": "chatlearn_entrypoint.py (Pai-Megatron-Patch's *_chatlearn.sh)",
    **dict.fromkeys(["--config-name", "--config-path"], "hydra (verl's trainer)"),
    **dict.fromkeys(["--checkpoint-path", "--tokenizer", "--data", "--tensorboard-logs-path", "--help",
                     "--distributed-config-file"], "the script's own options (examples/gptoss/02_train.sh)"),
}
FLAG = re.compile(r"(?<![\w-])--[A-Za-z0-9][A-Za-z0-9_-]*")


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], capture_output=True, text=True, check=True).stdout


def collect(repo: str, ref: str, paths: list[str], source: str) -> list[dict]:
    commit = _git(repo, "rev-parse", f"{ref}^{{commit}}").strip()
    scripts = []
    for path in paths:
        flags = sorted(set(FLAG.findall(_git(repo, "show", f"{commit}:{path}"))) - set(NOT_PROGRAM_FLAGS))
        scripts.append({"repo": source, "ref": ref, "commit": commit, "path": path, "flags": flags})
    return scripts


def main(megatron_lm: str, megatron_lm_ref: str, pai: str, pai_ref: str) -> None:
    recipes = [p for p in _git(pai, "ls-tree", "-r", "--name-only", pai_ref, "examples").split()
               if re.fullmatch(r"examples/[^/]+/run_mcore_[^/]*\.sh", p)]
    scripts = (collect(megatron_lm, megatron_lm_ref, MEGATRON_LM_SCRIPTS, "https://github.com/NVIDIA/Megatron-LM")
               + collect(pai, pai_ref, recipes, "https://github.com/alibaba/Pai-Megatron-Patch"))
    json.dump({"scripts": scripts, "not_program_flags": NOT_PROGRAM_FLAGS}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main(*sys.argv[1:])
