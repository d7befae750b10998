"""The seed document's ``Finetuner`` script (MyFintuner), adapted as little as possible:

- the ``datasets`` library is not installed here, so ``load_dataset(...).map(tokenize_function, ...)`` becomes a
  list comprehension over ``load_sentence_pair_dataset`` (same columns), and ``load_metric`` becomes
  ``SequenceClassificationMetric`` (accuracy and F1, as GLUE/MRPC's metric);
- the tokenizer's hub name ``"bert-base-cased"`` becomes ``--pretrained-model-name-or-path`` (a local directory);
- obvious typos: ``args = get_args()`` where the snippet used ``args`` undefined, and the missing imports.

The model is loaded from ``args.load`` as the snippet does: its launch command gives only
``--pretrained-model-name-or-path``, which ``args.load`` then names.
"""
import torch
from transformers import AutoTokenizer, BertForSequenceClassification

from rapidformer import (Finetuner, RapidformerEngine, SequenceClassificationMetric, get_args,
                         load_sentence_pair_dataset)


class MyFintuner(Finetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args = get_args()
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)

        def tokenize_function(examples):
            # max_length=None => use the model max length (it's actually the default)
            outputs = tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None)
            return outputs

        datasets = load_sentence_pair_dataset(args.dataset_path, args.dataset_name)
        tokenized_datasets = {split: [{**tokenize_function(row), "labels": row["label"]} for row in rows]
                              for split, rows in datasets.items()}
        train_dataset = tokenized_datasets["train"]
        valid_dataset = tokenized_datasets['validation']
        test_dataset = tokenized_datasets.get('test')

        def collate_fn(examples):
            return tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return train_dataset, valid_dataset, test_dataset, collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = BertForSequenceClassification.from_pretrained(args.load)
        return model, None, None

    def run_forward_step(self, batch, model):
        output_tensor = model(**batch)
        return output_tensor.loss

    # after each epoch run metric on eval dataset
    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        metric = SequenceClassificationMetric()
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            metric.add_batch(
                predictions=self.gather(predictions),
                references=self.gather(batch["labels"]),
            )
        eval_metric = metric.compute()
        return eval_metric


engine = RapidformerEngine()
trainer = MyFintuner(engine=engine)
trainer.train()
