"""Preference tuning (DPO) of a megatron-core GPT on chosen/rejected pairs: the reference model's log-probabilities
from one pass over the pairs before training (the model as loaded; with LoRA the base), then TRL's DPO loss
(``--dpo-loss-type sigmoid|ipo``, ``--dpo-beta``) as the mean over the global batch's pairs, logged with TRL's rewards,
accuracy and margin; the dev set's after each epoch and every ``--eval-interval`` iterations. The Rapidformer
Finetuner template.

Example::

    megatron-patch preprocess-data --dpo --input prefs.jsonl --output-prefix data/prefs \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./qwen2-sft-hf
    rapidformer --user-script examples/gpt/dpo_gpt.py --dpo --nproc-per-node 2 --tensor-model-parallel-size 2 \\
        --load ./qwen2-sft --finetune --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./qwen2-sft-hf \\
        --data-path data/prefs_dpo_document --split 98,2,0 --seq-length 4096 --epochs 1 --micro-batch-size 1 \\
        --global-batch-size 32 --lr 5e-7 --dpo-beta 0.1 --save ./qwen2-dpo

A resumed run (``--load`` of its own ``--save``) reads the reference log-probabilities saved there at its start.
"""

from megatron_patch.training.dpo import DPOSettings, ReferenceLogps, dpo_forward_step, dpo_metrics
from megatron_patch.training.models import megatron_model
from megatron_patch.training.sft import sft_datasets
from rapidformer import Finetuner, RapidformerEngine


class DPOFinetuner(Finetuner):
    LOSS_NAME = "dpo loss"

    def train_valid_test_datasets_provider(self):
        if not self.args.dpo:
            raise SystemExit("rapidformer: error: examples/gpt/dpo_gpt.py trains on preference pairs: add --dpo, "
                             "with --data-path naming preprocess-data --dpo prefixes")
        self.train_set, self.dev_set = sft_datasets(self.config, self.engine.tokenizer, self.engine.logger)
        return self.train_set, self.dev_set, None, None

    def model_optimizer_lr_scheduler_provider(self):
        model, self.checkpoint_info = megatron_model(self.engine, family="gpt")
        return model, None, None

    def after_load(self):
        self.reference = ReferenceLogps.for_run(self, self.train_set, self.dev_set, log=self.engine.logger.info)
        self.settings = DPOSettings.of(self.config.data)

    def run_forward_step(self, batch, model):
        return dpo_forward_step(batch, model, self.reference.train, self.settings)

    def run_compute_metrics(self, model, eval_dataloader):
        return dpo_metrics(model, eval_dataloader, self.args.seq_length, self.reference.dev, self.settings)


if __name__ == "__main__":
    DPOFinetuner(engine=RapidformerEngine()).train()
