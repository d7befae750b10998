"""Pretrain a megatron-core BERT: masked LM plus next-sentence prediction on sentence-split mmap data.

Example::

    megatron-patch preprocess-data --input corpus.jsonl --output-prefix data/corpus --split-sentences \
        --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt
    rapidformer --user-script examples/bert/pretrain_bert.py --nproc-per-node 2 --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --tokenizer-type \
        BertWordPieceLowerCase --vocab-file vocab.txt --data-path data/corpus_text_sentence --split 980,20 \
        --micro-batch-size 8 --global-batch-size 16 --train-iters 100 --lr 1e-3 --save bert-ckpt

The shape flags build Megatron's BERT (pre-LN, two segment types, the next-sentence head unless
``--bert-no-binary-head``); ``--model-name bert-base`` (or tiny-bert) is the original post-LN BERT, and
``--load`` a ``megatron-patch convert hf-to-megatron`` conversion of a Hugging Face BertForPreTraining continues
from it. ``rapidformer --task pretraining`` with the same flags runs the same trainer.
examples/bert/finetune_classification.py fine-tunes the saved weights (``--load bert-ckpt --finetune``).
"""

from megatron_patch.training.bert import BertPretrainer
from rapidformer import RapidformerEngine

if __name__ == "__main__":
    BertPretrainer(engine=RapidformerEngine()).train()
