#!/usr/bin/env bash
# Pretrain a BERT (masked LM + next-sentence prediction) with examples/bert/pretrain_bert.py on sentence-split
# mmap data (megatron-patch preprocess-data --split-sentences).
#
#   examples/bert/run_pretrain_bert.sh --model-size bert-base --data-path data/corpus_text_sentence \
#       --vocab-file bert-vocab.txt --micro-batch-size 16 --global-batch-size 256 --output-dir out/bert-base
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=6010 examples/bert/run_pretrain_bert.sh \
#       --model-size bert-large --tp 2 --distributed-optimizer --data-path data/corpus_text_sentence \
#       --vocab-file bert-vocab.txt --global-batch-size 1024 --train-iters 100000        # on each node
#   examples/bert/run_pretrain_bert.sh --cpu --nproc-per-node 2 ...             # a tiny BERT on CPU processes
#
# --help lists the flags; anything after -- goes to rapidformer (e.g. -- --bert-no-binary-head --mask-prob 0.15).
RECIPE=pretrain_bert
RECIPE_SUMMARY="Pretrain a BERT with examples/bert/pretrain_bert.py (megatron-core BERT, sentence-split mmap data)."
DEFAULT_MODEL=bert-base CPU_MODEL=tiny-bert DEFAULT_TOKENIZER=BertWordPieceLowerCase
DEFAULT_LR=1e-4 DEFAULT_MIN_LR=1e-5 DEFAULT_TRAIN_ITERS=1000
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/common.sh"
parse_flags "$@"
launch --user-script "$ROOT/examples/bert/pretrain_bert.py" --lr-decay-style linear
