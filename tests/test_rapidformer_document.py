"""
    python -m pytest -q tests/test_rapidformer_document.py

Rapidformer's document, run as written, needs no change the project causes (tests/test_rapidformer_cli.py runs its
six usage patterns; these are the promises underneath, each checked where it is decided):

- its Finetuner loads the model with ``from_pretrained(args.load)`` although its command gives only
  ``--pretrained-model-name-or-path``: the user scripts' ``args.load`` names that directory, while the run's
  ``config.checkpointing.load`` (what a trainer resumes from) stays empty;
- a sequence classifier's loss is logged as ``classification loss``, a language model's as ``lm loss``;
- shape flags that contradict the pretrained model's ``config.json`` are refused in one line at parse time, naming
  the flag, the file, its value there and the fix; a ``--seq-length`` within the model's positions is accepted.
"""

import json
import logging
import os
import subprocess
import sys

import pytest

from megatron_patch.testing import logged_messages, run_on_ranks
from megatron_patch.training.arguments import parse_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bert-base-uncased's config.json (the document's --pretrained-model-name-or-path), shape fields only.
BERT_BASE = dict(model_type="bert", num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512, vocab_size=30522)
# gpt2's config.json names the same fields differently (n_inner null: 4 x n_embd).
GPT2 = dict(model_type="gpt2", n_layer=12, n_embd=768, n_head=12, n_inner=None, n_positions=1024, vocab_size=50257)


def _model_dir(tmp_path, config: dict) -> str:
    path = tmp_path / config["model_type"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


# -- args.load -------------------------------------------------------------------------------------------------
def test_args_load_names_the_pretrained_directory_but_nothing_resumes_from_it(tmp_path):
    bert = _model_dir(tmp_path, BERT_BASE)
    config, args = parse_run(["--pretrained-model-name-or-path", bert, "--exit-on-missing-checkpoint"], 1)
    assert args.load == bert  # BertForSequenceClassification.from_pretrained(args.load), as the document has it
    # The trainers resume from config.checkpointing.load; with --exit-on-missing-checkpoint a Hugging Face
    # directory there would be refused as a checkpoint without its tracker file.
    assert config.checkpointing.load is None and config.checkpoint_info is None

    checkpoint = str(tmp_path / "checkpoints")
    config, args = parse_run(["--pretrained-model-name-or-path", bert, "--load", checkpoint], 1)
    assert args.load == config.checkpointing.load == checkpoint  # a given --load is kept

    config, args = parse_run(["--micro-batch-size", "1"], 1)
    assert args.load is None and config.checkpointing.load is None


# -- the loss's name -------------------------------------------------------------------------------------------
def _log_lines(loss_name: str | None) -> list[str]:
    from megatron_patch.training.metrics import TrainingLog

    logger = logging.getLogger("test_rapidformer_document")
    logger.setLevel(logging.INFO)
    with logged_messages(logger) as messages:
        named = {} if loss_name is None else {"loss_name": loss_name}
        log = TrainingLog(logger, log_interval=1, train_iters=1, **named)
        log.step(iteration=1, consumed_samples=8, lr=1e-4, loss=0.69, grad_norm=1.0, loss_scale=1.0, skipped=False,
                 step_time=0.1, tokens=256, samples=8)
        log.validation(iteration=1, loss=0.7)
        log.close()
    return messages


def test_the_log_names_the_loss_it_is_given():
    step, validation = _log_lines("classification loss")
    assert "| classification loss: 6.900000E-01 |" in step and "lm loss" not in step
    assert "| classification loss: 7.000000E-01 |" in validation and "lm loss" not in validation
    step, validation = _log_lines(None)  # a language model's, as Megatron-LM's log has it
    assert "| lm loss: 6.900000E-01 |" in step and "| lm loss: 7.000000E-01 |" in validation


def composed_loss_names(rank, world_size):
    import torch
    import transformers

    from megatron_patch.model.builder import build_model_chunks, build_sequence_classifier
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.training.engine import Engine

    engine = Engine(["--micro-batch-size", "1", "--train-iters", "1"])
    bert = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=16)
    tiny_bert = get_model_config("tiny-bert")
    models = {
        "hf classifier": transformers.BertForSequenceClassification(bert),
        "hf pretraining": transformers.BertForPreTraining(bert),
        "hf causal lm": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16)),
        "plain torch": torch.nn.Linear(4, 2),
        "megatron classifier": build_sequence_classifier(tiny_bert, ParallelConfig(), 128, num_labels=2),
        "megatron bert": build_model_chunks(tiny_bert, ParallelConfig(), 128),
        "megatron gpt": build_model_chunks(get_model_config("tiny-gpt2"), ParallelConfig(), 128),
    }
    names = {}
    for kind, model in models.items():
        engine.compose(model)
        names[kind] = engine.backend.loss_name
    return names


def test_each_backend_names_a_classifiers_loss_by_what_it_is():
    [names] = run_on_ranks(composed_loss_names, 1)
    assert names == {"hf classifier": "classification loss", "hf pretraining": "lm loss", "hf causal lm": "lm loss",
                     "plain torch": "lm loss", "megatron classifier": "classification loss",
                     "megatron bert": "lm loss", "megatron gpt": "lm loss"}


# -- shape flags against config.json ---------------------------------------------------------------------------
@pytest.mark.parametrize("config, flag, value, key, stored", [
    (BERT_BASE, "--hidden-size", "64", "hidden_size", 768),
    (BERT_BASE, "--num-layers", "2", "num_hidden_layers", 12),
    (BERT_BASE, "--num-attention-heads", "4", "num_attention_heads", 12),
    (BERT_BASE, "--ffn-hidden-size", "128", "intermediate_size", 3072),
    (BERT_BASE, "--max-position-embeddings", "1024", "max_position_embeddings", 512),
    (BERT_BASE, "--vocab-size", "1000", "vocab_size", 30522),
    (GPT2, "--num-layers", "2", "n_layer", 12),
    (GPT2, "--hidden-size", "64", "n_embd", 768),
])
def test_a_shape_flag_that_contradicts_config_json_is_refused(tmp_path, config, flag, value, key, stored):
    model = _model_dir(tmp_path, config)
    with pytest.raises(SystemExit) as refused:
        parse_run(["--pretrained-model-name-or-path", model, flag, value], 1)
    message = str(refused.value)
    path = os.path.join(model, "config.json")
    assert message == (f"rapidformer: error: {flag} {value} contradicts {key}={stored} in {path} (the pretrained "
                       f"model); drop {flag} or give {stored}")


@pytest.mark.parametrize("config, key, limit", [(BERT_BASE, "max_position_embeddings", 512),
                                               (GPT2, "n_positions", 1024)])
def test_seq_length_beyond_the_models_positions_is_refused(tmp_path, config, key, limit):
    model = _model_dir(tmp_path, config)
    with pytest.raises(SystemExit) as refused:
        parse_run(["--pretrained-model-name-or-path", model, "--seq-length", str(limit + 1)], 1)
    assert str(refused.value) == (
        f"rapidformer: error: --seq-length {limit + 1} exceeds {key}={limit} in "
        f"{os.path.join(model, 'config.json')} (the pretrained model has no positions beyond it); give "
        f"--seq-length {limit} or less")


def test_the_documents_flags_and_a_shorter_seq_length_are_accepted(tmp_path):
    model = _model_dir(tmp_path, BERT_BASE)
    # The document's BERT pretraining command states bert-base-uncased's own shape.
    document = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "512",
                "--max-position-embeddings", "512"]
    config, args = parse_run(["--pretrained-model-name-or-path", model, *document], 1)
    assert (args.hidden_size, config.data.seq_length) == (768, 512)
    config, _ = parse_run(["--pretrained-model-name-or-path", model, "--seq-length", "128"], 1)
    assert config.data.seq_length == 128  # only the samples are shorter


def test_the_launcher_refuses_before_any_rank_starts(tmp_path):
    model = _model_dir(tmp_path, BERT_BASE)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_patch.training.launcher", "--task", "sequence_classification",
         "--nproc-per-node", "2", "--pretrained-model-name-or-path", model, "--data-path", str(tmp_path),
         "--data-name", "mrpc", "--hidden-size", "64"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"rapidformer: error: --hidden-size 64 contradicts hidden_size=768 in {os.path.join(model, 'config.json')} "
        "(the pretrained model); drop --hidden-size or give 768"]
    assert "torch.distributed.run" not in done.stdout
