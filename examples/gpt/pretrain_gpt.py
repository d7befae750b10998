"""Pretrain a megatron-core GPT (GPT-2, LLaMA, Qwen2 shapes) on mmap documents; the Rapidformer Pretrainer template.

Example::

    megatron-patch preprocess-data --input corpus.jsonl --output-prefix data/corpus --append-eod \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
    rapidformer --user-script examples/gpt/pretrain_gpt.py --nproc-per-node 2 --tensor-model-parallel-size 2 \
        --model-name tiny-llama --seq-length 32 --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json \
        --merge-file merges.txt --data-path data/corpus_text_document --split 980,20 --micro-batch-size 4 \
        --global-batch-size 8 --train-iters 100 --lr 3e-3 --save ckpt

The model comes from the model flags (``--num-layers --hidden-size ...``) or ``--model-name``, or, with
``--load DIR``, from ``DIR/megatron_patch_args.json``: a conversion (``megatron-patch convert hf-to-megatron``:
continued pretraining of a Hugging Face model, weights only, from iteration 0) or one of this script's saves
(a resume: weights, optimizer, scheduler and data position; ``--finetune`` takes the weights only).
"""

from megatron_patch.training.gpt import gpt_datasets, gpt_forward_step
from megatron_patch.training.models import megatron_model
from rapidformer import Pretrainer, RapidformerEngine


class GPTPretrainer(Pretrainer):
    def model_optimizer_lr_scheduler_provider(self):
        # checkpoint_info describes the model in each save, so `--load SAVE` and megatron-to-hf need no flags.
        model, self.checkpoint_info = megatron_model(self.engine, family="gpt")
        return model, None, None  # None: megatron-core's optimizer and scheduler from the flags

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        return gpt_datasets(self.config.data, self.engine.tokenizer, train_val_test_num_samples,
                            self.config.training.seed)

    def run_forward_step(self, data_iterator, model):
        return gpt_forward_step(data_iterator, model)


if __name__ == "__main__":
    GPTPretrainer(engine=RapidformerEngine()).train()
