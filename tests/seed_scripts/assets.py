"""Local stand-ins for the seed document's hub names: mmap GPT/BERT data, a tiny Hugging Face BERT directory
and an MRPC-shaped GLUE directory, built once per test session from the shared stdlib corpus.

    from seed_scripts.assets import rapidformer_assets
    assets = rapidformer_assets(tmp_path_factory)
    assets.gpt_prefix, assets.bert_prefix, assets.bert_dir, assets.glue_dir
"""

import dataclasses
import os

from conftest_data import data_assets

from megatron_patch.data.preprocess import PreprocessConfig, preprocess
from megatron_patch.data.stand_ins import write_glue

_CACHE = {}


@dataclasses.dataclass
class RapidformerAssets:
    gpt_prefix: str
    gpt_options: dict
    bert_prefix: str
    vocab_file: str
    bert_dir: str
    glue_dir: str


def _write_bert_dir(path: str, vocab_file: str) -> None:
    import torch
    from transformers import BertConfig, BertForPreTraining, BertTokenizerFast

    with open(vocab_file) as f:
        vocab_size = sum(1 for _ in f)
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, initializer_range=0.2)
    torch.manual_seed(0)  # the same random "pretrained" weights every session, so the tests learn alike
    BertForPreTraining(config).save_pretrained(path)
    # transformers 5 takes the vocabulary as `vocab` (a path or a dict); `vocab_file=` is silently ignored and
    # gives a tokenizer that maps every word to [UNK].
    BertTokenizerFast(vocab=vocab_file, do_lower_case=True).save_pretrained(path)


def rapidformer_assets(tmp_path_factory) -> RapidformerAssets:
    if "assets" in _CACHE:
        return _CACHE["assets"]
    data = data_assets(tmp_path_factory)
    root = str(tmp_path_factory.mktemp("rapidformer_assets"))
    gpt_options = data.options["GPT2BPETokenizer"]
    preprocess(PreprocessConfig(input=data.corpus, output_prefix=os.path.join(root, "gpt"),
                                tokenizer_type="GPT2BPETokenizer", tokenizer_options=gpt_options, append_eod=True))
    vocab_file = data.options["BertWordPieceLowerCase"]["vocab_file"]
    preprocess(PreprocessConfig(input=data.corpus, output_prefix=os.path.join(root, "bert"),
                                tokenizer_type="BertWordPieceLowerCase", tokenizer_options={"vocab_file": vocab_file},
                                split_sentences=True))
    _write_bert_dir(os.path.join(root, "bert-tiny"), vocab_file)
    write_glue(os.path.join(root, "glue", "mrpc"))
    _CACHE["assets"] = RapidformerAssets(
        gpt_prefix=os.path.join(root, "gpt_text_document"), gpt_options=gpt_options,
        bert_prefix=os.path.join(root, "bert_text_sentence"), vocab_file=vocab_file,
        bert_dir=os.path.join(root, "bert-tiny"), glue_dir=os.path.join(root, "glue"))
    return _CACHE["assets"]
