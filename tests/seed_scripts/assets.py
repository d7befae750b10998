"""Local stand-ins for the seed document's hub names: mmap GPT/BERT data, a tiny Hugging Face BERT directory
and an MRPC-shaped GLUE directory, built once per test session from the shared stdlib corpus.

    from seed_scripts.assets import rapidformer_assets
    assets = rapidformer_assets(tmp_path_factory)
    assets.gpt_prefix, assets.bert_prefix, assets.bert_dir, assets.glue_dir
"""

import dataclasses
import os
import random

from conftest_data import data_assets

from megatron_patch.data.preprocess import PreprocessConfig, preprocess

_CACHE = {}


@dataclasses.dataclass
class RapidformerAssets:
    gpt_prefix: str
    gpt_options: dict
    bert_prefix: str
    vocab_file: str
    bert_dir: str
    glue_dir: str


def _write_glue(root: str, seed: int = 0) -> None:
    """MRPC's TSV layout with a label a tiny model learns in a few dozen steps: 1 when the first sentence opens
    with one of three keywords, 0 with one of three others (whole words of the test WordPiece vocabulary, which
    was trained on code; a keyword anywhere in the sentence took a random-init 2-layer BERT far longer)."""
    rng = random.Random(seed)
    keywords = ["return", "yield", "raise", "import", "class", "def"]
    fillers = ["the", "self", "value", "name", "data", "list", "key", "new", "for", "if", "while", "with"]
    os.makedirs(os.path.join(root, "mrpc"), exist_ok=True)
    for split, count in (("train", 256), ("dev", 64)):
        with open(os.path.join(root, "mrpc", f"{split}.tsv"), "w") as f:
            f.write("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n")
            for i in range(count):
                a, b = rng.choice(keywords), rng.choice(keywords)
                label = keywords.index(a) < 3
                s1 = " ".join([a] + rng.sample(fillers, 5))
                s2 = " ".join(rng.sample(fillers, 2) + [b] + rng.sample(fillers, 3))
                f.write(f"{int(label)}\t{i}\t{i + 10000}\t{s1}\t{s2}\n")


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
    _write_glue(os.path.join(root, "glue"))
    _CACHE["assets"] = RapidformerAssets(
        gpt_prefix=os.path.join(root, "gpt_text_document"), gpt_options=gpt_options,
        bert_prefix=os.path.join(root, "bert_text_sentence"), vocab_file=vocab_file,
        bert_dir=os.path.join(root, "bert-tiny"), glue_dir=os.path.join(root, "glue"))
    return _CACHE["assets"]
