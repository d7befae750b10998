#!/usr/bin/env bash
# Pretrain a GPT-style model (GPT-2, LLaMA, Qwen2 shapes) with examples/gpt/pretrain_gpt.py on mmap data.
#
#   examples/gpt/run_pretrain_gpt.sh --model-size gpt2-124m --data-path data/corpus_text_document \
#       --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --global-batch-size 64
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=6010 examples/gpt/run_pretrain_gpt.sh \
#       --model-size llama2-7b --tp 4 --pp 2 --sp --distributed-optimizer --recompute selective \
#       --tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --data-path data/corpus_text_document \
#       --global-batch-size 256 --train-tokens 100000000000 --output-dir /ckpt/llama2-7b      # on each node
#   examples/gpt/run_pretrain_gpt.sh --cpu --nproc-per-node 2 --tp 2 ...       # a tiny model on CPU processes
#   examples/gpt/run_pretrain_gpt.sh --model-size mixtral-8x7b --tp 2 --sp --ep 8 --etp 1 --pp 4 \
#       --distributed-optimizer ... -- --moe-aux-loss-coeff 0.01     # experts split over 8 ranks (on 64 GPUs)
#
# --help lists the flags; anything after -- goes to rapidformer (e.g. -- --eval-interval 100 --split 98,2,0).
RECIPE=pretrain_gpt
RECIPE_SUMMARY="Pretrain a GPT-style model with examples/gpt/pretrain_gpt.py (megatron-core GPT, mmap documents)."
DEFAULT_MODEL=gpt2-124m CPU_MODEL=tiny-gpt2 DEFAULT_TOKENIZER=GPT2BPETokenizer
DEFAULT_LR=3e-4 DEFAULT_MIN_LR=3e-5 DEFAULT_TRAIN_ITERS=1000
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/common.sh"
parse_flags "$@"
launch --user-script "$ROOT/examples/gpt/pretrain_gpt.py" --lr-decay-style cosine
