"""Supervised fine-tuning (SFT) of a megatron-core GPT on prompt/response pairs: the loss covers the response
tokens only; response loss and perplexity on the dev split after every epoch. The Rapidformer Finetuner template.

Example::

    megatron-patch convert hf-to-megatron --hf-dir ./Qwen2-0.5B --save-dir ./qwen2-mcore
    # data/sft/train.jsonl and dev.jsonl: one {"prompt": "...", "response": "..."} per line
    rapidformer --user-script examples/gpt/finetune_gpt.py --nproc-per-node 2 --tensor-model-parallel-size 2 \
        --load ./qwen2-mcore --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./qwen2-mcore/hf_tokenizer \
        --data-path data/sft --seq-length 512 --epochs 2 --micro-batch-size 4 --global-batch-size 32 --lr 1e-5 \
        --save ./qwen2-sft
    megatron-patch convert megatron-to-hf --load-dir ./qwen2-sft --save-dir ./Qwen2-0.5B-sft

The model comes from ``--load`` (a conversion: weights only, from iteration 0; one of our saves with
``--finetune``) or from the model flags. Continued pretraining on raw documents is examples/gpt/pretrain_gpt.py
with ``--load``.
"""

from megatron_patch.training.gpt import SFTDataset, load_sft_dataset, sft_forward_step, sft_metrics
from megatron_patch.training.models import megatron_model
from rapidformer import Finetuner, RapidformerEngine


class SFTFinetuner(Finetuner):
    def train_valid_test_datasets_provider(self):
        args = self.args
        splits = load_sft_dataset(args.data_path[0], args.data_name)
        train, dev = (SFTDataset(splits[s], self.engine.tokenizer, args.seq_length) if s in splits else None
                      for s in ("train", "validation"))
        return train, dev, None, None  # collate None: samples are already padded to --seq-length

    def model_optimizer_lr_scheduler_provider(self):
        model, self.checkpoint_info = megatron_model(self.engine, family="gpt")
        return model, None, None

    def run_forward_step(self, batch, model):
        return sft_forward_step(batch, model)

    def run_compute_metrics(self, model, eval_dataloader):
        return sft_metrics(model, eval_dataloader, self.args.seq_length)


if __name__ == "__main__":
    SFTFinetuner(engine=RapidformerEngine()).train()
