"""Fine-tune a megatron-core BERT sequence classifier on a GLUE-style sentence-pair task; accuracy and F1 on the
dev split after every epoch. The Rapidformer Finetuner template.

Example::

    # data/glue/mrpc/train.tsv and dev.tsv in MRPC's columns (Quality, #1 ID, #2 ID, #1 String, #2 String)
    rapidformer --user-script examples/bert/finetune_classification.py --nproc-per-node 2 \
        --load bert-ckpt --finetune --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt \
        --data-path data/glue --data-name mrpc --seq-length 64 --epochs 3 --micro-batch-size 16 --lr 2e-5

``--load bert-ckpt --finetune`` starts from the encoder and pooler that examples/bert/pretrain_bert.py saved (the
model flags come from its ``megatron_patch_args.json``); the classifier layer starts random. Without ``--load``
the model comes from the flags (``--num-layers ...`` or ``--model-name tiny-bert``).
"""

from megatron_patch.training.bert import SentencePairDataset, classification_forward_step, classification_metrics
from megatron_patch.training.models import megatron_model
from rapidformer import Finetuner, RapidformerEngine, load_sentence_pair_dataset


class PairClassificationFinetuner(Finetuner):
    def train_valid_test_datasets_provider(self):
        args = self.args
        splits = load_sentence_pair_dataset(args.data_path[0], args.data_name)
        self.num_labels = max(row["label"] for row in splits["train"]) + 1
        train, dev = (SentencePairDataset(splits[s], self.engine.tokenizer, args.seq_length) if s in splits else None
                      for s in ("train", "validation"))
        return train, dev, None, None  # collate None: samples are already padded to --seq-length

    def model_optimizer_lr_scheduler_provider(self):
        model, self.checkpoint_info = megatron_model(self.engine, family="bert", num_labels=self.num_labels)
        return model, None, None

    def run_forward_step(self, batch, model):
        return classification_forward_step(batch, model, self.checkpoint_info.model_config)

    def run_compute_metrics(self, model, eval_dataloader):
        return classification_metrics(model, eval_dataloader, self.checkpoint_info.model_config,
                                      self.args.seq_length, self.gather)


if __name__ == "__main__":
    PairClassificationFinetuner(engine=RapidformerEngine()).train()
