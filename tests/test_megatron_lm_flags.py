"""Megatron-LM's launch flags: the flag sets of its examples/ scripts at core_v0.16.1 (tests/data/
megatron_lm_example_flags.json: examples/llama/train_llama3_8b_h100_fp8.sh with mock and with real data,
examples/gpt3/train_gpt3_175b_distributed.sh, examples/bert/train_bert_340m_distributed.sh) parse, and each
semantic flag reaches the megatron-core object it acts on; a sample-counted schedule with a batch ramp-up trains
with the learning rates and global batches of Megatron-LM's formulas (computed here from its definitions);
``--task pretraining`` with BERT flags trains a BertModel; the log starts with Megatron-LM's arguments block."""

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import re

import pytest
from seed_scripts.assets import rapidformer_assets

from megatron_patch.testing import run_on_ranks

FLAG_SETS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "megatron_lm_example_flags.json")))
SETS = [(script, variant) for script, variants in FLAG_SETS["scripts"].items() for variant in variants]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _replace(argv: list[str], values: dict[str, list[str] | None]) -> list[str]:
    """``argv`` with each flag in ``values`` given those values instead, or added with them (None: the flag
    dropped, with its values)."""
    out, skip, pending = [], False, dict(values)
    for word in argv:
        if word.startswith("--"):
            skip = word in values
            if skip and pending.get(word) is not None:
                out += [word, *pending.pop(word)]  # a flag given twice keeps one copy
            elif not skip:
                out.append(word)
        elif not skip:
            out.append(word)
    for flag, given in pending.items():
        if given is not None and flag not in argv:
            out += [flag, *given]
    return out


def _tiny(script: str, variant: str, assets, tmp_path) -> list[str]:
    """The script's flags at a size a CPU trains in seconds, with this machine's files: 8B/175B/340M shapes
    shrunk, tensor/pipeline parallelism 1, no --load/--save/--tensorboard-dir, local data and tokenizers."""
    shape = {"--num-layers": ["2"], "--hidden-size": ["64"], "--num-attention-heads": ["4"], "--seq-length": ["32"],
             "--max-position-embeddings": ["32"], "--ffn-hidden-size": ["128"], "--num-query-groups": ["2"],
             "--kv-channels": ["16"], "--tensor-model-parallel-size": ["1"], "--pipeline-model-parallel-size": ["1"],
             "--load": None, "--save": None, "--save-interval": None, "--tensorboard-dir": None, "--split": ["98,2,0"],
             "--data-cache-path": [str(tmp_path / "cache")], "--num-workers": ["0"], "--micro-batch-size": ["1"],
             "--global-batch-size": ["8"], "--vocab-size": ["128"]}
    if "llama" in script:
        shape.update({"--train-samples": ["64"], "--lr-decay-samples": ["48"], "--lr-warmup-samples": ["16"],
                      "--tokenizer-type": ["NullTokenizer"], "--tokenizer-model": None, "--data-path": None,
                      "--mock-data": []})
    elif "gpt3" in script:
        shape.update({"--rampup-batch-size": ["2", "2", "12"], "--train-iters": ["6"], "--lr-decay-iters": ["5"],
                      "--vocab-file": [assets.gpt_options["vocab_file"]],
                      "--merge-file": [assets.gpt_options["merge_file"]], "--data-path": [assets.gpt_prefix],
                      "--tokenizer-type": ["GPT2BPETokenizer"]})
    else:  # Megatron-LM's BERT script names no tokenizer (its default, None, fails there too)
        shape.update({"--train-iters": ["4"], "--lr-decay-iters": ["3"], "--vocab-file": [assets.vocab_file],
                      "--data-path": [assets.bert_prefix], "--tokenizer-type": ["BertWordPieceLowerCase"],
                      "--seq-length": ["64"], "--max-position-embeddings": ["64"]})
    return _replace(FLAG_SETS["scripts"][script][variant], shape)


@pytest.mark.parametrize("script, variant", SETS)
def test_example_flag_sets_parse_and_log_what_this_machine_ignores(script, variant):
    from megatron_patch.training.arguments import parse_args

    argv = FLAG_SETS["scripts"][script][variant]
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None and "--tensorboard-dir" in argv:
        with pytest.raises(SystemExit, match="--tensorboard-dir needs the tensorboard package"):
            parse_args(argv)
        argv = _replace(argv, {"--tensorboard-dir": None})
    args = parse_args(argv)
    given = {word for word in argv if word.startswith("--")}
    import torch

    from megatron_patch import compat

    # What needs Transformer Engine or CUDA is logged as ignored here, one line per flag, never silently.
    absent = not (compat.transformer_engine_available() and torch.cuda.is_available())
    expected = {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"} & given \
        if absent else set()
    if not torch.cuda.is_available():
        expected |= {"--profile", "--empty-unused-memory-level"} & given
    if not compat.transformer_engine_available() and "--attention-backend" in given:
        backend = argv[argv.index("--attention-backend") + 1]
        expected |= {"--attention-backend"} if backend in ("flash", "fused", "unfused") else set()
    ignored = {re.match(r"ignored on this machine: (--[\w-]+)", n).group(1) for n in args.flag_notices
               if n.startswith("ignored on this machine")}
    assert ignored == expected, args.flag_notices
    if "--use-mcore-models" in given:
        assert any("--use-mcore-models" in n for n in args.flag_notices)
    if "--sequence-parallel" in given and args.tensor_model_parallel_size == 1:
        assert args.sequence_parallel is False  # Megatron-LM turns it off at TP=1 too
    # The semantic flags land in the parsed settings with their values.
    for flag in ("--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--decoupled-lr",
                 "--decoupled-min-lr", "--exit-duration-in-mins"):
        if flag in given:
            assert getattr(args, flag[2:].replace("-", "_")) == pytest.approx(float(argv[argv.index(flag) + 1]))
    if "--rampup-batch-size" in given:
        start = argv.index("--rampup-batch-size") + 1
        assert args.rampup_batch_size == [int(v) for v in argv[start:start + 3]]


def compose_example(rank, world_size, argv):
    """What megatron-core was given for the flags: the scheduler, DDP and model configs, optimizer groups,
    the microbatch calculator's batch after 0 and after 6 samples, and the norms' initial weights."""
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, update_num_microbatches
    from megatron.core.utils import get_model_config

    from megatron_patch.training.engine import Engine
    from megatron_patch.training.models import megatron_model
    from megatron_patch.training.tasks import pretraining_family

    engine = Engine(argv)
    family = pretraining_family(engine.config)
    chunks, info = megatron_model(engine, family=family)
    model, optimizer, scheduler = engine.compose(chunks)
    config = get_model_config(model[0])
    batches = []
    for consumed in (0, 6):
        update_num_microbatches(consumed, consistency_check=False)
        batches.append(get_current_global_batch_size())
    embedding = sum(p.numel() for p in model[0].parameters() if getattr(p, "is_embedding_or_output_parameter", False))
    # (max lr, min lr, elements) per group: the groups hold fp32 copies of the parameters, counted by size.
    groups = [(g.get("max_lr"), g.get("min_lr"), sum(p.numel() for p in g["params"])) for g in optimizer.param_groups]
    norms = [m.weight.detach().abs().max().item() for n, m in model[0].named_modules()
             if n.endswith("layernorm") and getattr(m, "weight", None) is not None]
    return dict(embedding=embedding, family=family, train_iters=engine.args.train_iters,
                warmup=scheduler.lr_warmup_steps, decay=scheduler.lr_decay_steps,
                overlap_grad_reduce=model[0].ddp_config.overlap_grad_reduce,
                overlap_param_gather=model[0].ddp_config.overlap_param_gather,
                grad_reduce_in_fp32=model[0].ddp_config.grad_reduce_in_fp32,
                per_token=config.calculate_per_token_loss, ce_fusion=config.cross_entropy_loss_fusion,
                zero_centered=config.layernorm_zero_centered_gamma, batches=batches, groups=groups, norms=norms)


def _megatron_train_iters(train_samples, global_batch, rampup):
    """megatron/training/training.py update_train_iters: ramp-up iterations while at most the ramp-up's (and
    the run's) samples are consumed, then whole global batches."""
    if rampup is None:
        return train_samples // global_batch
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += _megatron_batch(consumed, global_batch, rampup)
        iterations += 1
    return iterations + max(0, train_samples - consumed) // global_batch


def _megatron_batch(consumed, global_batch, rampup):
    """The global batch after ``consumed`` samples (RampupBatchsizeNumMicroBatchesCalculator's definition:
    START plus INCR for every SAMPLES / ((GLOBAL - START) / INCR) samples consumed, GLOBAL after SAMPLES)."""
    if rampup is None or consumed > rampup[2]:
        return global_batch
    start, increment, samples = rampup
    return start + int(consumed / (samples / ((global_batch - start) // increment))) * increment


@pytest.mark.parametrize("script, variant", [s for s in SETS if s[1] != "real data"])
def test_example_flags_reach_megatron_core(script, variant, assets, tmp_path):
    argv = _tiny(script, variant, assets, tmp_path)
    [got] = run_on_ranks(compose_example, 1, args=(argv,), timeout=300)

    def value(flag, cast=float):
        return cast(argv[argv.index(flag) + 1]) if flag in argv else None

    gbs = value("--global-batch-size", int)
    start = argv.index("--rampup-batch-size") + 1 if "--rampup-batch-size" in argv else None
    rampup = [int(v) for v in argv[start:start + 3]] if start else None
    assert got["family"] == ("bert" if "bert" in script else "gpt")
    # megatron/training/training.py get_optimizer_param_scheduler: counts in samples either way.
    if "--train-samples" in argv:
        assert got["train_iters"] == _megatron_train_iters(value("--train-samples", int), gbs, rampup)
        assert got["decay"] == value("--lr-decay-samples", int)
        assert got["warmup"] == value("--lr-warmup-samples", int)
    else:
        assert got["decay"] == value("--lr-decay-iters", int) * gbs
        assert got["warmup"] == pytest.approx(value("--lr-warmup-fraction") * value("--lr-decay-iters", int) * gbs)
    assert got["batches"] == [_megatron_batch(c, gbs, rampup) for c in (0, 6)]
    assert got["overlap_grad_reduce"] == ("--overlap-grad-reduce" in argv)
    assert got["overlap_param_gather"] == ("--overlap-param-gather" in argv)
    # Megatron-LM reduces in fp32 under --bf16 unless --grad-reduce-in-bf16.
    if "--bf16" in argv:
        assert got["grad_reduce_in_fp32"] == ("--grad-reduce-in-bf16" not in argv)
    assert got["per_token"] == ("--calculate-per-token-loss" in argv)
    assert got["ce_fusion"] == ("--cross-entropy-loss-fusion" in argv)
    assert got["zero_centered"] == ("--apply-layernorm-1p" in argv)
    if "--apply-layernorm-1p" in argv:  # gamma - 1 starts at 0
        assert got["norms"] and max(got["norms"]) == 0.0
    if "--decoupled-lr" in argv:  # megatron-core's optimizer: its own max/min lr for embedding and output layer
        decoupled = (value("--decoupled-lr"), value("--decoupled-min-lr"))
        assert {(g[0], g[1]) for g in got["groups"]} == {decoupled, (value("--lr"), value("--min-lr"))}
        assert sum(g[2] for g in got["groups"] if (g[0], g[1]) == decoupled) == got["embedding"] > 0


def _megatron_lr(samples, lr, min_lr, warmup, decay, style):
    """megatron-core OptimizerParamScheduler.get_lr (init_lr 0): linear warmup, then linear or cosine decay."""
    if warmup > 0 and samples <= warmup:
        return lr * samples / warmup
    if samples > decay:
        return min_lr
    ratio = (samples - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)


def train_pretraining_task(rank, world_size, argv, exit_early=False):
    """``--task pretraining`` in this process; returns the trainer's class, the unwrapped model's class, the
    log lines, the iterations done, and the garbage collections that ran while it trained (generation)."""
    import gc
    import logging

    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import TASKS

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("rapidformer").addHandler(handler)
    collections = []

    def record(phase, info):
        if phase == "start" and not gc.isenabled():  # gc.collect() while automatic collection is off
            collections.append(info["generation"])

    try:
        with contextlib.redirect_stdout(stream):
            engine = Engine(argv)
            if exit_early:
                engine.start_time -= 3600  # started an hour ago, as far as --exit-duration-in-mins sees
            trainer = TASKS["pretraining"](engine)
            gc.callbacks.append(record)
            try:
                trainer.train()
            finally:
                gc.callbacks.remove(record)
            was_enabled = gc.isenabled()
    finally:
        logging.getLogger("rapidformer").removeHandler(handler)
    module = trainer.model[0]
    while hasattr(module, "module"):
        module = module.module
    return dict(trainer=type(trainer).__name__, model=type(module).__name__, log=stream.getvalue(),
                iteration=trainer.iteration, collections=collections, gc_enabled_after=was_enabled)


def test_sample_schedule_with_rampup_trains_at_megatron_lm_learning_rates_and_batches(assets, tmp_path):
    lr, min_lr, gbs, rampup, samples, warmup, decay = 1e-3, 1e-4, 8, [2, 2, 12], 40, 6, 30
    argv = _tiny("examples/llama/train_llama3_8b_h100_fp8.sh", "mock data", assets, tmp_path)
    argv = _replace(argv, {
        "--train-samples": [str(samples)], "--lr-warmup-samples": [str(warmup)], "--lr-decay-samples": [str(decay)],
        "--lr": [str(lr)], "--min-lr": [str(min_lr)], "--rampup-batch-size": [str(v) for v in rampup],
        "--global-batch-size": [str(gbs)], "--micro-batch-size": ["1"], "--eval-interval": None,
        "--exit-duration-in-mins": None, "--manual-gc-interval": ["2"], "--log-dir": [str(tmp_path / "log")],
        "--seq-length": ["16"], "--max-position-embeddings": ["16"],
    })
    results = run_on_ranks(train_pretraining_task, 2, args=(argv,), timeout=600)
    with open(tmp_path / "log" / "iterations.jsonl") as f:
        record = [json.loads(line) for line in f]
    iterations = _megatron_train_iters(samples, gbs, rampup)
    assert len(record) == iterations
    consumed, batches, rates = 0, [], []
    for _ in range(iterations):
        batches.append(_megatron_batch(consumed, gbs, rampup))
        consumed += batches[-1]
        rates.append(_megatron_lr(consumed, lr, min_lr, warmup, decay, "cosine"))
    assert [r["global_batch_size"] for r in record] == batches
    assert batches[0] < gbs and batches[-1] == gbs  # the ramp-up happened
    assert [r["consumed_samples"] for r in record] == list(itertools.accumulate(batches))
    assert [r["lr"] for r in record] == pytest.approx(rates, rel=1e-6)
    assert all(math.isfinite(r["loss"]) for r in record)
    # --manual-gc: automatic collection off while training, full collections at the start and every 2nd
    # iteration, and on again afterwards (torch.compile of the fused cross-entropy collects generation 1 itself).
    for result in results:
        assert result["collections"].count(2) == 1 + iterations // 2, (iterations, result["collections"])
        assert result["gc_enabled_after"]


def test_exit_duration_in_mins_saves_and_stops(assets, tmp_path):
    argv = _tiny("examples/gpt3/train_gpt3_175b_distributed.sh", "as shipped", assets, tmp_path)
    argv = _replace(argv, {"--rampup-batch-size": None, "--eval-interval": None, "--save-interval": None,
                           "--save": [str(tmp_path / "ckpt")], "--exit-duration-in-mins": ["1"]})
    [result] = run_on_ranks(train_pretraining_task, 1, args=(argv, True), timeout=300)
    assert result["iteration"] == 1
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read() == "1"


def test_pretraining_task_with_bert_flags_trains_bert_and_logs_lm_and_sop_loss(assets, tmp_path):
    argv = _tiny("examples/bert/train_bert_340m_distributed.sh", "as shipped", assets, tmp_path)
    argv = _replace(argv, {"--log-interval": ["1"], "--eval-interval": None, "--fp16": None,
                           "--lr": ["1e-3"]})
    [result] = run_on_ranks(train_pretraining_task, 1, args=(argv,), timeout=300)
    assert result["model"] == "BertModel", result["model"]
    lines = [line for line in result["log"].splitlines() if " iteration " in line]
    assert len(lines) == 4, result["log"][-3000:]
    for line in lines:
        assert re.search(r"\| lm loss: [0-9.E+-]+ \| sop loss: [0-9.E+-]+ \|", line), line
    sop = [float(re.search(r"sop loss: ([0-9.E+-]+)", line).group(1)) for line in lines]
    assert all(0.0 < value < 5.0 for value in sop)  # a cross-entropy over two classes starts near ln 2


def construct_engine(rank, world_size, argv):
    from megatron_patch.training.engine import Engine

    stream = io.StringIO()
    with contextlib.redirect_stdout(stream):
        engine = Engine(argv)
    settings = {name[len("_switch_"):] if name.startswith("_switch_") else name: value
                for name, value in vars(engine.args).items()}
    return stream.getvalue(), {name: str(value) for name, value in settings.items()}


def test_megatron_lm_arguments_block_is_written_to_the_log_dir_once_from_rank_0(tmp_path):
    argv = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "0.001", "--train-iters", "3",
            "--swiglu", "--profile", "--log-dir", str(tmp_path)]
    (printed, settings), (second, _) = run_on_ranks(construct_engine, 2, args=(argv,))
    assert "arguments" not in second
    # One line points to the block, which --debug alone prints (issue 53: it was ~210 of a run's ~220 lines).
    assert printed.splitlines()[0] == f"[rapidformer] arguments: {tmp_path / 'arguments.txt'}", printed
    assert "end of arguments" not in printed
    first = (tmp_path / "arguments.txt").read_text()
    lines = first.splitlines()
    begin = lines.index("------------------------ arguments ------------------------")
    end = lines.index("-------------------- end of arguments ---------------------")
    assert begin == 0 and first.count("end of arguments") == 1
    # megatron/training/arguments.py _print_args: "  name" + " " + dots to column 48 + " " + value, sorted by the
    # lowercased line.
    expected = sorted((f"  {name} {'.' * (48 - len(name))} {value}" for name, value in settings.items()),
                      key=lambda line: line.lower())
    assert lines[begin + 1:end] == expected
    assert "  micro_batch_size " + "." * 32 + " 2" in lines
    assert "  num_microbatches " + "." * 32 + " 2" in lines  # an effective setting derived at start-up
    assert "  swiglu " + "." * 42 + " True" in lines
    # The notices follow, from rank 0 only.
    assert any(line.startswith("[rapidformer] ignored on this machine: --profile") for line in printed.splitlines())


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_transformer_impl_picks_the_layers_and_says_what_this_machine_ignores(monkeypatch, impl):
    """Failed before: ``--transformer-impl``, in Megatron-LM's and Pai-Megatron-Patch's recipes, was refused as an
    unrecognized argument. ``local`` keeps megatron-core's local layers on a machine with Transformer Engine too."""
    from megatron_patch import compat
    from megatron_patch.model import get_model_config
    from megatron_patch.model.specs import LocalBackend, backend
    from megatron_patch.training.arguments import parse_run

    config, args = parse_run(["--micro-batch-size", "1", "--transformer-impl", impl], 1)
    assert config.parallel.transformer_impl == impl
    ignored = [n for n in args.flag_notices if "--transformer-impl" in n]
    assert len(ignored) == (impl == "transformer_engine" and not compat.transformer_engine_available()), ignored
    if impl == "local":
        monkeypatch.setattr(compat, "transformer_engine_available", lambda: True)  # as on a GPU machine
        assert isinstance(backend(config.parallel), LocalBackend)
        with pytest.raises(ValueError, match=re.escape("--context-parallel-size greater than 1 needs Transformer "
                                                       "Engine, but --transformer-impl local is given")):
            dataclasses.replace(config.parallel, context_parallel_size=2).validate(get_model_config("gpt2-124m"))
