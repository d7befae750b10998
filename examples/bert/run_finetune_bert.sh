#!/usr/bin/env bash
# Fine-tune a BERT sequence classifier on a GLUE-style sentence-pair task (DIR/NAME/train.tsv and dev.tsv in
# MRPC's columns) with examples/bert/finetune_classification.py; accuracy and F1 on dev after every epoch.
#
#   examples/bert/run_finetune_bert.sh --load output/pretrain_bert-bert-base/checkpoints --data-path data/glue \
#       --data-name mrpc --vocab-file bert-vocab.txt --seq-length 128 --epochs 3 --micro-batch-size 16
#   examples/bert/run_finetune_bert.sh --cpu --nproc-per-node 2 ...     # a tiny BERT on CPU processes
#
# --load DIR starts from a checkpoint of run_pretrain_bert.sh (or a Hugging Face BERT converted with `megatron-patch
# convert hf-to-megatron`): its weights only (--finetune); the classifier layer starts random. Without --load the
# model is --model-size's, from random weights. --help lists the flags; anything after -- goes to rapidformer.
RECIPE=finetune_bert
RECIPE_SUMMARY="Fine-tune a BERT classifier with examples/bert/finetune_classification.py (GLUE-style pairs)."
DEFAULT_MODEL=bert-base CPU_MODEL=tiny-bert DEFAULT_TOKENIZER=BertWordPieceLowerCase
DEFAULT_LR=2e-5 DEFAULT_MIN_LR=0 DEFAULT_TRAIN_ITERS=""  # the epochs decide
source "$(dirname "${BASH_SOURCE[0]}")/../../run_scripts/common.sh"
parse_flags "$@"
launch --user-script "$ROOT/examples/bert/finetune_classification.py" --lr-decay-style linear ${LOAD:+--finetune}
