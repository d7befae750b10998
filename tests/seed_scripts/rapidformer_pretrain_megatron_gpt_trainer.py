"""The seed document's "Pretrainer for a Megatron GPT" script, adapted: ``GPTModel()`` from "yourmodel" is built
from the flags with megatron_patch.model, and the imports the snippet left out are added."""
import torch
from megatron import mpu

from megatron_patch.model import model_config_from_args, parallel_config_from_args
from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
from rapidformer import (PreTrainer, RapidformerEngine, build_train_valid_test_datasets, get_args,
                         get_ltor_masks_and_position_ids, get_tokenizer)


class MyGPTPreTrainer(PreTrainer):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = get_args()
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
            data_prefix=args.data_path, data_impl=args.data_impl, splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples, seq_length=args.seq_length,
            seed=args.seed, skip_warmup=(not args.mmap_warmup))
        return train_ds, valid_ds, test_ds

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        config = model_config_from_args(args, vocab_size=get_tokenizer().vocab_size)
        vocab = padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by,
                                  args.tensor_model_parallel_size)
        model = build_model_chunks(config, parallel_config_from_args(args, config.num_layers), vocab)
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        """Forward step."""
        args = get_args()
        tokenizer = get_tokenizer()
        # Items and their type.
        keys = ['text']
        datatype = torch.int64
        # Broadcast data.
        if data_iterator is not None:
            data = next(data_iterator)
        else:
            data = None
        data_b = mpu.broadcast_data(keys, data, datatype)
        # Unpack.
        tokens_ = data_b['text'].long()
        labels = tokens_[:, 1:].contiguous()
        tokens = tokens_[:, :-1].contiguous()
        # Get the masks and postition ids.
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
        losses = output_tensor.float()
        loss_mask = loss_mask.view(-1).float()
        loss = torch.sum(losses.view(-1) * loss_mask) / loss_mask.sum()
        return loss


engine = RapidformerEngine()
trainer = MyGPTPreTrainer(engine=engine)
trainer.train()
