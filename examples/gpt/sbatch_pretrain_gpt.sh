#!/usr/bin/env bash
# Pretrain on a Slurm cluster: one launcher per node (srun --ntasks-per-node=1), each starting one rank per GPU.
#
#   sbatch examples/gpt/sbatch_pretrain_gpt.sh --model-size llama2-7b --tp 4 --pp 2 --sp --distributed-optimizer \
#       --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --data-path data/corpus_text_document \
#       --global-batch-size 256 --train-tokens 100000000000 --output-dir /lustre/$USER/llama2-7b
#
# Every flag goes to examples/gpt/run_pretrain_gpt.sh (--help lists them). Under srun the launcher takes NNODES and
# NODE_RANK from the step (SLURM_STEP_NUM_NODES, SLURM_PROCID), MASTER_ADDR from the first host of
# SLURM_STEP_NODELIST and MASTER_PORT from the job id, unless they are set; it finds the network interface itself
# (set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME on a cluster whose nodes share several networks). The output directory
# must be on a file system every node sees. A preemption or the time limit's SIGTERM reaches each launcher, whose
# ranks save before they exit: rerunning the same command resumes.
# Submit from the checkout's root: sbatch runs a copy of this file, so the recipe is found from SLURM_SUBMIT_DIR.
#SBATCH --job-name=pretrain-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
# No --kill-on-bad-exit: the launchers end together by themselves, each printing which node failed first.
srun --ntasks-per-node=1 examples/gpt/run_pretrain_gpt.sh "$@"
