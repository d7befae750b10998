#!/usr/bin/env bash
# Supervised fine-tuning (SFT) of a GPT-style chat model on conversations with examples/gpt/finetune_gpt.py --sft:
# the loss on the assistant's tokens, conversations packed into --seq-length sequences; the dev loss after every
# epoch.
#
#   examples/gpt/run_finetune_gpt.sh --load ckpt/qwen2-mcore --tokenizer-model hf/qwen2 --data-path chat.jsonl \
#       --seq-length 4096 --global-batch-size 64 --epochs 2 --tp 2 -- --split 98,2,0
#   examples/gpt/run_finetune_gpt.sh --cpu --nproc-per-node 2 ...     # a tiny model on CPU processes
#
# --data-path takes .jsonl files (OpenAI messages, ShareGPT, prompt/completion, Alpaca; prepared with the tokenizer's
# chat template before any rank starts) or prefixes from `megatron-patch preprocess-data --sft`. --load DIR starts
# from a checkpoint's weights (--finetune; e.g. a Hugging Face model converted with `megatron-patch convert
# hf-to-megatron`); a rerun resumes from OUTPUT/checkpoints instead, once it holds one. --help lists the flags;
# anything after -- goes to rapidformer (--no-sft-packing, --sft-loss last-turn, --lora-rank 8, --eval-interval N).
RECIPE=finetune_gpt
RECIPE_SUMMARY="Fine-tune a GPT-style chat model on conversations with examples/gpt/finetune_gpt.py --sft."
DEFAULT_MODEL=qwen2-0.5b CPU_MODEL=tiny-llama DEFAULT_TOKENIZER=HuggingFaceTokenizer
DEFAULT_LR=1e-5 DEFAULT_MIN_LR=0 DEFAULT_TRAIN_ITERS=""  # the epochs decide
LOAD_FINETUNES=1  # --load starts the first run (--finetune); a rerun resumes from OUTPUT/checkpoints
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/common.sh"
parse_flags "$@"
launch --user-script "$ROOT/examples/gpt/finetune_gpt.py" --sft --lr-decay-style cosine
