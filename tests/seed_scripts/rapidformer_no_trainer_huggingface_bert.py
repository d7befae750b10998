"""The seed document's no-trainer fine-tuning script after its Rapidformer changes (``engine.compose``,
``finetuner.build_data_loader``, ``engine.gather``). Adapted as little as possible:

- hub names become ``--pretrained-model-name-or-path`` and ``--data-path``/``--data-name``;
- the ``datasets`` library is not installed here: ``load_dataset(...).map(...)`` becomes a list comprehension over
  ``load_sentence_pair_dataset`` and ``load_metric`` becomes ``SequenceClassificationMetric``;
- transformers 5 has no ``AdamW`` (the Rapidformer version no longer uses it), so its import goes; the imports and
  the ``args = get_args()`` the snippet left out are added.
"""
from functools import partial

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

from rapidformer import (Finetuner, RapidformerEngine, SequenceClassificationMetric, get_args,
                         load_sentence_pair_dataset)

engine = RapidformerEngine()
finetuner = Finetuner(engine=engine)
args = get_args()

tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
datasets = load_sentence_pair_dataset(args.dataset_path, args.dataset_name)
metric = SequenceClassificationMetric()


def tokenize_function(examples):
    # max_length=None => use the model max length (it's actually the default)
    outputs = tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None)
    return outputs


tokenized_datasets = {split: [{**tokenize_function(row), "labels": row["label"]} for row in rows]
                      for split, rows in datasets.items()}

model = AutoModelForSequenceClassification.from_pretrained(args.pretrained_model_name_or_path, return_dict=True)

lr_scheduler = partial(
    get_linear_schedule_with_warmup,
    num_warmup_steps=args.lr_warmup_iters,
    num_training_steps=args.train_iters
)
model, optimizer, lr_scheduler = engine.compose(model_obj=model, lr_scheduler_fn=lr_scheduler)
train_dataloader = finetuner.build_data_loader(tokenized_datasets["train"])
eval_dataloader = finetuner.build_data_loader(tokenized_datasets["validation"])

for epoch in range(args.epochs):
    model.train()
    for step, batch in enumerate(train_dataloader):
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        print("epoch {} step {} loss {:.4f}".format(epoch, step, loss.item()))

    model.eval()
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            outputs = model(**batch)
        predictions = outputs.logits.argmax(dim=-1)
        metric.add_batch(
            predictions=engine.gather(predictions),
            references=engine.gather(batch["labels"]))
    eval_metric = metric.compute()
    print("epoch {}: {}".format(epoch, eval_metric))
