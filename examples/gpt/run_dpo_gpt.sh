#!/usr/bin/env bash
# Preference tuning (DPO) of a GPT-style chat model, fine-tuned first, on chosen/rejected pairs with
# examples/gpt/dpo_gpt.py --dpo: the reference model's log-probabilities in one pass before the first step, then
# TRL's DPO loss, rewards, accuracy and margin; the dev set's after every epoch.
#
#   examples/gpt/run_dpo_gpt.sh --load ckpt/qwen2-sft --tokenizer-model hf/qwen2-sft \
#       --data-path data/prefs_dpo_document --seq-length 4096 --global-batch-size 64 --epochs 1 --tp 2 \
#       -- --split 98,2,0 --dpo-beta 0.1
#   examples/gpt/run_dpo_gpt.sh --cpu --nproc-per-node 2 ...     # a tiny model on CPU processes
#
# --data-path takes prefixes from `megatron-patch preprocess-data --dpo`, or the .jsonl pairs themselves (prepared
# before any rank starts, once: the cache keeps them). --load DIR starts from a checkpoint's
# weights (--finetune; the SFT run's checkpoints, or a Hugging Face chat model converted with `megatron-patch convert
# hf-to-megatron`); a rerun resumes from OUTPUT/checkpoints instead, once it holds one, with the reference
# log-probabilities saved there. --help lists the flags; anything after -- goes to rapidformer (--dpo-beta,
# --dpo-loss-type ipo, --dpo-sft-loss-weight 0.1, --no-sft-packing, --lora-rank 8, --eval-interval N).
RECIPE=dpo_gpt
RECIPE_SUMMARY="Preference-tune (DPO) a GPT-style chat model on chosen/rejected pairs with examples/gpt/dpo_gpt.py \
--dpo."
DEFAULT_MODEL=qwen2-0.5b CPU_MODEL=tiny-llama DEFAULT_TOKENIZER=HuggingFaceTokenizer
DEFAULT_LR=1e-6 DEFAULT_MIN_LR=0 DEFAULT_TRAIN_ITERS=""  # the epochs decide; TRL's learning rate
LOAD_FINETUNES=1  # --load starts the first run (--finetune); a rerun resumes from OUTPUT/checkpoints
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/common.sh"
parse_flags "$@"
launch --user-script "$ROOT/examples/gpt/dpo_gpt.py" --dpo --lr-decay-style cosine
