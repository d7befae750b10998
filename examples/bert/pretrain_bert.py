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
from it. examples/bert/finetune_classification.py fine-tunes the saved weights (``--load bert-ckpt --finetune``).
"""

from megatron_patch.training.bert import bert_datasets, bert_forward_step
from megatron_patch.training.models import megatron_model
from rapidformer import Pretrainer, RapidformerEngine


class BertPretrainer(Pretrainer):
    def model_optimizer_lr_scheduler_provider(self):
        model, self.checkpoint_info = megatron_model(self.engine, family="bert")
        return model, None, None  # None: megatron-core's optimizer and scheduler from the flags

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        # The model is built first: whether it has the binary head decides the samples (sentence pairs or not).
        return bert_datasets(self.args, self.engine.tokenizer, train_val_test_num_samples,
                             self.checkpoint_info.model_config)

    def run_forward_step(self, data_iterator, model):
        return bert_forward_step(data_iterator, model, self.checkpoint_info.model_config)


if __name__ == "__main__":
    BertPretrainer(engine=RapidformerEngine()).train()
