"""Supervised fine-tuning (SFT) of a megatron-core GPT on conversations: the loss covers the tokens the chat
template marks as the assistant's (``--sft-loss``), per token over the global batch; conversations packed into
``--seq-length`` sequences, each attending to itself only (``--no-sft-packing``: one per sample); the dev loss over
every trained token after each epoch and every ``--eval-interval`` iterations. The Rapidformer Finetuner template.

Example::

    megatron-patch convert hf-to-megatron --hf-dir ./Qwen2-0.5B-Instruct --save-dir ./qwen2-mcore
    megatron-patch preprocess-data --sft --input chat.jsonl --output-prefix data/chat \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./qwen2-mcore/hf_tokenizer --show 1   # check it
    megatron-patch preprocess-data --sft --input chat.jsonl --output-prefix data/chat \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./qwen2-mcore/hf_tokenizer --workers 8
    rapidformer --user-script examples/gpt/finetune_gpt.py --sft --nproc-per-node 2 --tensor-model-parallel-size 2 \
        --load ./qwen2-mcore --finetune --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model ./qwen2-mcore/hf_tokenizer --data-path data/chat_sft_document --split 98,2,0 \
        --seq-length 4096 --epochs 2 --micro-batch-size 1 --global-batch-size 32 --lr 1e-5 --save ./qwen2-sft
    megatron-patch convert megatron-to-hf --load-dir ./qwen2-sft --save-dir ./Qwen2-0.5B-sft

``--data-path`` (or ``--train-data-path``/``--valid-data-path``) may name the ``.jsonl`` files themselves: the launcher
prepares them into ``--data-cache-path`` first. The model comes from ``--load`` (a conversion: weights only, from
iteration 0; one of our saves with ``--finetune``) or from the model flags; ``--lora-rank`` trains adapters only.
"""

from megatron_patch.training.models import megatron_model
from megatron_patch.training.sft import sft_datasets, sft_forward_step, sft_metrics
from rapidformer import Finetuner, RapidformerEngine


class SFTFinetuner(Finetuner):
    def train_valid_test_datasets_provider(self):
        if not self.args.sft:
            raise SystemExit("rapidformer: error: examples/gpt/finetune_gpt.py trains on conversations: add --sft "
                             "(Megatron-LM's flag), with --data-path naming .jsonl files or preprocess-data --sft "
                             "prefixes")
        train, dev = sft_datasets(self.config, self.engine.tokenizer, self.engine.logger)
        return train, dev, None, None  # collate None: samples are --seq-length long already

    def model_optimizer_lr_scheduler_provider(self):
        model, self.checkpoint_info = megatron_model(self.engine, family="gpt")
        return model, None, None

    def run_forward_step(self, batch, model):
        return sft_forward_step(batch, model)

    def run_compute_metrics(self, model, eval_dataloader):
        return sft_metrics(model, eval_dataloader, self.args.seq_length, self.args.micro_batch_size)


if __name__ == "__main__":
    SFTFinetuner(engine=RapidformerEngine()).train()
