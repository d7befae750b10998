"""Fine-tune a Hugging Face BERT on sentence pairs in your own training loop: Rapidformer's no-trainer API.

Example::

    rapidformer --user-script examples/bert/finetune_classification_no_trainer.py --nproc-per-node 2 \
        --pretrained-model-name-or-path ./bert-base-uncased --data-path data/glue --data-name mrpc --epochs 3 \
        --micro-batch-size 16 --lr 2e-5 --lr-warmup-iters 10 --mixed-precision --zero-1-memory-optimization

``engine.compose`` wraps the model for the flags' data parallelism and memory mode and builds AdamW with the
flags' schedule; ``engine.build_data_loader`` gives this rank its share of the data, on its device;
``engine.backward`` scales the loss under ``--mixed-precision``; ``engine.gather`` collects every rank's
predictions for the metrics. The loop itself is yours. (examples/bert/finetune_classification.py is the same task
with the Finetuner template and a megatron-core model.)
"""

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from megatron_patch.training.tasks import HuggingFacePairDataset
from rapidformer import RapidformerEngine, SequenceClassificationMetric, get_args, load_sentence_pair_dataset

engine = RapidformerEngine()
args = get_args()
if not (args.pretrained_model_name_or_path and args.epochs):
    raise SystemExit("rapidformer: error: this script needs --pretrained-model-name-or-path DIR and --epochs N")

tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
splits = load_sentence_pair_dataset(args.data_path[0], args.data_name)
train_loader = engine.build_data_loader(HuggingFacePairDataset(splits["train"], tokenizer, args.seq_length))
eval_loader = engine.build_data_loader(HuggingFacePairDataset(splits["validation"], tokenizer, args.seq_length),
                                       shuffle=False)
model = AutoModelForSequenceClassification.from_pretrained(
    args.pretrained_model_name_or_path, num_labels=max(row["label"] for row in splits["train"]) + 1)
# train_iters: the length of the learning-rate schedule, in optimizer steps.
model, optimizer, lr_scheduler = engine.compose(model, train_iters=args.epochs * len(train_loader))
metric = SequenceClassificationMetric()

for epoch in range(args.epochs):
    model.train()
    train_loader.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
    for step, batch in enumerate(train_loader):
        loss = model(**batch).loss
        engine.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        engine.print_rank_0(f"epoch {epoch} step {step} loss {loss.item():.4f}")
    model.eval()
    with torch.no_grad():
        for batch in eval_loader:
            predictions = model(**batch).logits.argmax(dim=-1)
            metric.add_batch(predictions=engine.gather(predictions), references=engine.gather(batch["labels"]))
    engine.print_rank_0(f"epoch {epoch} | " + " | ".join(f"{k}: {v:.4f}" for k, v in metric.compute().items()))
