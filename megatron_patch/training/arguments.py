"""The ``rapidformer`` command line, parsed once per process into the typed ``RunConfig`` (training/config.py),
whose fields declare the flags: Megatron-LM's names plus the Rapidformer flags.

Example::

    config, args = parse_run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                              "--mixed-precision", "--zero-1-memory-optimization"], world_size=2)
    config.precision, config.training.memory_optimization, config.training.num_microbatches  # 'fp16', 'zero-1', 2
    args.num_microbatches                      # 2: the same run under Megatron-LM's names, for user scripts

The flow of one run: ``parse_flags`` reads the command line into a Namespace that nothing changes afterwards;
``run_config`` refuses what is wrong, resolves the model (``--load``'s record, ``--model-name`` or the shape flags)
and checks the layout on the world size, building each frozen section once; ``args_view`` is Megatron-LM's
``args`` made from it, read-only (``get_args()``). The launcher builds the RunConfig in its parent (so a bad flag
is one line before any rank starts) and again in each rank, whose engine takes that parse (``parse_run``'s
hand-over) instead of parsing again.

Unknown flags are refused with their names (``allow_abbrev`` is off, so a typo never silently matches a longer
flag), and every conflict names both flags and the fix. ``--load DIR`` with ``DIR/megatron_patch_args.json`` (a
conversion's or our trainer's) or Megatron-LM's own checkpoint (the ``args`` in its common.pt or rank files) supplies
the model flags not given, as Megatron-LM's ``--use-checkpoint-args``. ``--pretrained-model-name-or-path DIR`` with a
``DIR/config.json`` refuses the shape flags that contradict it; user scripts' ``args.load`` names ``DIR`` when
``--load`` is not given (Rapidformer's Finetuner template loads ``from_pretrained(args.load)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from megatron_patch.checkpoint.format import find_info, read_tracker
from megatron_patch.compat import PrintVersions
from megatron_patch.errors import FlagParser, did_you_mean, option_strings
from megatron_patch.model.config import (
    SWITCH_FLAGS, VALUE_FLAGS, HF_SIZE_KEYS, add_model_arguments, hf_size_key, model_flag_values, switch_name,
)
from megatron_patch.flags import add_flags, from_flags
from megatron_patch.model.parallel import add_parallel_arguments, parallel_config_from_args, precision_of
from megatron_patch.tokenizer.registry import add_tokenizer_args, tokenizer_options
from megatron_patch.training.config import (
    MEMORY_FLAGS, MEMORY_HELP, ArgsView, CheckpointConfig, DataConfig, LoggingConfig, LoraConfig, ModelSpec,
    RunConfig, TrainingConfig, args_view,
)
from megatron_patch.training.ignored_flags import add_ignored_flags, flag_notices, refusal

# What ``rapidformer --help`` opens with, before its ~650 lines of flags (tests/test_prelaunch.py parses each).
HELP_EXAMPLES = (
    ("pretrain a GPT at TP=2 on 2 processes; rerun the same line to resume from ckpt/gpt",
     "--task pretraining --nproc-per-node 2 --model-name tiny-gpt2 --tensor-model-parallel-size 2 "
     "--data-path data/gpt_text_document --tokenizer-type GPT2BPETokenizer --vocab-file tok/gpt2/vocab.json "
     "--merge-file tok/gpt2/merges.txt --micro-batch-size 4 --global-batch-size 8 --train-iters 100 --lr 3e-3 "
     "--split 98,2,0 --save ckpt/gpt --load ckpt/gpt"),
    ("fine-tune a Hugging Face BERT on a GLUE task, no code (black-box)",
     "--task sequence_classification --nproc-per-node 2 --pretrained-model-name-or-path hf/bert "
     "--data-path data/glue --data-name mrpc --epochs 3 --micro-batch-size 8 --lr 2e-5 --zero-1-memory-optimization"),
    ("run your own Pretrainer/Finetuner subclass or training loop (white-box)",
     "--user-script my_finetuner.py --nproc-per-node 2 --pretrained-model-name-or-path hf/bert "
     "--data-path data/glue --data-name mrpc --epochs 3 --micro-batch-size 8 --mixed-precision"),
)


def _help_text(width: int = 110) -> str:
    import textwrap

    lines = [*textwrap.wrap("Train megatron-core, plain torch and Hugging Face models: black-box with --task, or "
                            "white-box with --user-script (a Pretrainer/Finetuner subclass or a no-trainer script).",
                            width, break_on_hyphens=False), "", "examples:"]
    for what, command in HELP_EXAMPLES:
        # Wrapped between flags, never between a flag and its value, each line continued as a shell reads it.
        wrapped = ["  rapidformer"]
        for pair in command.replace(" --", "\0--").split("\0"):
            if len(wrapped[-1]) + len(pair) + 3 > width:
                wrapped[-1] += " \\"
                wrapped.append("     ")
            wrapped[-1] += " " + pair
        lines += [f"  # {what}", *wrapped]
    lines += ["", "megatron-patch train takes the same flags; rapidformer --version prints the versions in use."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The full parser (also what ``rapidformer --help`` prints): the flags the RunConfig's fields declare, the
    model's (``model.config``), the layout's and precision's (``model.parallel``) and the tokenizer's."""
    # "megatron-patch train" when that command runs the launcher (cli._forward), so its usage line says so.
    called = os.path.basename(sys.argv[0])
    prog = called if called.startswith("megatron-patch ") else "rapidformer"
    # A usage line of its own: argparse's lists every flag, ~120 lines in front of the examples.
    parser = FlagParser(prog=prog, allow_abbrev=False, usage=f"{prog} (--task TASK | --user-script FILE) [FLAGS]",
                        description=_help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=PrintVersions, help="print the versions of this package, Python, torch, "
                        "megatron-core, Transformer Engine and apex, then exit")
    add_flags(parser, RunConfig, "rapidformer")
    memory = parser.add_argument_group("memory optimization (one of)")
    for dest, mode in MEMORY_FLAGS.items():
        memory.add_argument("--" + dest.replace("_", "-"), action="store_true", help=MEMORY_HELP[mode])
    add_model_arguments(parser)
    add_parallel_arguments(parser)
    add_tokenizer_args(parser)
    # Fine-tuning and HF models bring their own tokenizer, so the tokenizer type is optional here.
    parser._option_string_actions["--tokenizer-type"].required = False
    for section, title in ((TrainingConfig, "training"), (DataConfig, "data"), (CheckpointConfig, "checkpointing"),
                           (LoggingConfig, "logging"), (LoraConfig, "LoRA fine-tuning")):
        add_flags(parser, section, title)
    add_ignored_flags(parser)
    return parser


def _refuse(message: str):
    raise SystemExit(f"rapidformer: error: {message}")


def _memory_mode(flags: argparse.Namespace) -> str | None:
    chosen = [dest for dest in MEMORY_FLAGS if getattr(flags, dest)]
    if len(chosen) > 1:
        _refuse(f"{' and '.join('--' + d.replace('_', '-') for d in chosen)} conflict; choose one memory optimization")
    return MEMORY_FLAGS[chosen[0]] if chosen else None


def _check_pretrained_shape(flags: argparse.Namespace) -> int | None:
    """Refuse a shape flag that contradicts ``--pretrained-model-name-or-path DIR``'s ``config.json`` (the model
    ``from_pretrained`` loads, whatever the flags say), naming the flag, the file, its value and the fix; a
    ``--seq-length`` within the model's ``max_position_embeddings`` only shapes the run and is accepted. Returns
    those positions (None without a config.json that records them): the run's sequence length when --seq-length
    is not given, as the seed's ``tokenizer(..., truncation=True, max_length=None)`` truncates to the model's length.

    Example::

        parse_flags(["--pretrained-model-name-or-path", "bert-base", "--hidden-size", "64"])
        # SystemExit: rapidformer: error: --hidden-size 64 contradicts hidden_size=768 in bert-base/config.json ...

    config.json is read with json, not transformers, so the launcher's parse stays fast. A name that is not a
    local directory with a config.json (a hub name) is not checked.
    """
    path = os.path.join(flags.pretrained_model_name_or_path or "", "config.json")
    if not flags.pretrained_model_name_or_path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        stored = json.load(f)
    keys = {field: hf_size_key(stored, field) for field in HF_SIZE_KEYS}
    for field, key in keys.items():
        flag, given = "--" + field.replace("_", "-"), getattr(flags, field)
        if given is not None and key is not None and given != stored[key]:
            _refuse(f"{flag} {given} contradicts {key}={stored[key]} in {path} (the pretrained model); drop {flag} "
                    f"or give {stored[key]}")
    key = keys["max_position_embeddings"]
    if flags.seq_length is not None and key is not None and flags.seq_length > stored[key]:
        _refuse(f"--seq-length {flags.seq_length} exceeds {key}={stored[key]} in {path} (the pretrained model has no "
                f"positions beyond it); give --seq-length {stored[key]} or less")
    return stored[key] if key is not None else None


# Fields a flag may change on a stored model: they shape the training run, not the weights.
# The expert bias's update rate is a training hyperparameter like dropout (the weights do not depend on it).
_TRAINING_FIELDS = {"seq_length", "hidden_dropout", "attention_dropout", "init_method_std",
                    "moe_router_bias_update_rate"}


def _loaded_model(flags: argparse.Namespace) -> ModelSpec | None:
    """``--load``'s model: its ``megatron_patch_args.json`` or, without one, the Megatron-LM ``args`` in its
    common.pt or rank files (None without a Megatron checkpoint), as Megatron-LM's ``--use-checkpoint-args``
    takes them; a given model flag that contradicts the stored model is refused, the training-time ones replace
    the stored values.

    Example::

        _loaded_model(parse_flags(["--load", "llama-mcore", "--seq-length", "16"])).loaded.model_config.seq_length
    """
    found = find_info(flags.load) if flags.load else None
    if found is None:
        if flags.load and not flags.user_script and read_tracker(flags.load) is None \
                and os.path.isfile(os.path.join(flags.load, "config.json")):
            # Without this refusal the run warned that --load holds no checkpoint and trained random weights. A
            # user script's --load is the script's to read: the seed's Finetuner loads from_pretrained(args.load).
            _refuse(f"--load {flags.load} holds a Hugging Face model (config.json), not a Megatron checkpoint: "
                    f"convert it with `megatron-patch convert hf-to-megatron --hf-dir {flags.load} --save-dir "
                    "CONVERTED` and pass --load CONVERTED --finetune (or fine-tune it as it is with "
                    f"--pretrained-model-name-or-path {flags.load})")
        return None
    info, path = found
    stored = info.model_config
    if flags.model_name is not None:
        _refuse(f"--model-name {flags.model_name} conflicts with --load {flags.load}: {path} describes the model; "
                "drop --model-name")
    if flags.model_family not in (None, stored.family):
        _refuse(f"--model-family {flags.model_family} contradicts family={stored.family!r} in {path}")
    training = {}
    for flag, field, _ in VALUE_FLAGS:
        given, kept = getattr(flags, field), getattr(stored, field)
        if given is not None and field in _TRAINING_FIELDS:
            training[field] = given
        elif given not in (None, kept):
            _refuse(f"{flag} {given} contradicts {field}={kept!r} in {path}; drop {flag} (the stored model is "
                    "used) or load another checkpoint")
    for flag, field, value in SWITCH_FLAGS:
        if getattr(flags, switch_name(flag)) and getattr(stored, field) != value:
            _refuse(f"{flag} (sets {field}={value!r}) contradicts {field}={getattr(stored, field)!r} in {path}")
    loaded = dataclasses.replace(info, model_config=dataclasses.replace(stored, **training))
    return ModelSpec(name=None, family=stored.family, fields=(), loaded=loaded)


def _names_prefixes(flags: argparse.Namespace) -> bool:
    """Whether a user script's ``--data-path`` names mmap prefixes: a word has a ``.bin``/``.idx`` beside it, or
    no word is a file or directory itself (a fine-tuning script's JSON file or GLUE directory) and no
    ``--data-name``/``--dataset-name`` makes it a data set's name (the seed's ``--data-path glue --data-name mrpc``
    for ``load_dataset``)."""
    words = [word for value in flags.data_path for word in value.split()]
    if any(os.path.exists(word + suffix) for word in words for suffix in (".bin", ".idx")):
        return True
    return not (flags.data_name or flags.dataset_name or any(os.path.exists(word) for word in words))


def _check_prefix_words(words: list[str]) -> None:
    """Refuse a ``--data-path`` word that is a data file rather than its prefix, or preprocess's ``--output-prefix``
    where ``_text_document`` completes it to files that exist, naming the prefix to give: megatron-core appends
    ``.bin``/``.idx`` itself (the rank said ``.bin.bin not found``), and preprocess-data adds ``_text_document``."""
    for word in words:
        for suffix in (".bin", ".idx"):
            prefix = word[:-len(suffix)]
            if word.endswith(suffix) and os.path.isfile(prefix + ".bin"):
                _refuse(f"--data-path {word} names a data file; give its prefix, without {suffix}: "
                        f"--data-path {prefix}")
        completed = word + "_text_document"
        if not os.path.isfile(word + ".bin") and os.path.isfile(completed + ".bin"):
            _refuse(f"--data-path {word}: {word}.bin not found but {completed}.bin is (preprocess-data adds "
                    f"_text_document to its --output-prefix): give --data-path {completed}")


def _check_data_path(flags: argparse.Namespace, tokens: bool) -> None:
    """Pretraining's ``--data-path`` prefixes, their files found and their ``.idx`` read now, before torchrun starts
    and models are built: for ``--task pretraining`` and for user scripts (the recipes) whose ``--data-path`` names
    prefixes. With ``tokens`` (the launcher's check) their token ids too, against the tokenizer the flags name: a
    run on data of another tokenizer is refused before any rank starts, not after the model is built."""
    # --sft data is checked by _check_sft_run (its .jsonl files are prepared first).
    if flags.data_path and not flags.mock_data and not flags.sft and (
            flags.task == "pretraining" or (flags.user_script and _names_prefixes(flags))):
        from megatron_patch.data.data_path import check_data_path, check_token_ids, data_path_words

        try:
            _check_prefix_words(data_path_words(flags.data_path))
            prefixes = check_data_path(flags.data_path)
            if tokens and flags.tokenizer_type is not None:
                check_token_ids(prefixes, _tokenizer_size(flags))
        except ValueError as error:
            _refuse(str(error))


def _tokenizer_size(flags: argparse.Namespace) -> int:
    """The vocabulary of the tokenizer the flags name, built as the ranks build it; its files' errors name it."""
    from megatron_patch.tokenizer.registry import build_tokenizer

    try:
        return build_tokenizer(flags.tokenizer_type, **tokenizer_options(flags)).vocab_size
    except OSError as error:
        raise ValueError(f"--tokenizer-type {flags.tokenizer_type}: {error}") from error


def _check_resume_layout(flags: argparse.Namespace, parallel, data_parallel_size: int | None,
                         distributed: bool) -> None:
    """``--load``'s optimizer state against the run's layout (``checkpoint.megatron.check_resume_layout``), so
    that a resume it cannot load at is refused before any rank starts."""
    from megatron_patch.checkpoint.megatron import Layout, check_resume_layout
    from megatron_patch.errors import UserError

    requested = Layout(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                       parallel.virtual_pipeline_model_parallel_size or 1, parallel.expert_model_parallel_size,
                       data_parallel_size)
    try:
        check_resume_layout(flags.load, requested, distributed)
    except UserError as error:
        _refuse(str(error))


def _check_load_exists(flags: argparse.Namespace) -> None:
    """Refuse a ``--load`` directory that does not exist (a typo trained random weights and exited 0, its one
    notice lost in the log), except where it is ``--save`` too: the first run of a job that resumes or starts. A
    user script's ``--load`` may be a Hugging Face hub name for the script to read (``bert-base-cased``,
    ``Qwen/Qwen2-0.5B``): one or two words whose first is no local directory."""
    load = flags.load
    if not load or os.path.exists(load) or (flags.save and os.path.abspath(load) == os.path.abspath(flags.save)):
        return
    words = os.path.normpath(load).split(os.sep)
    if flags.user_script and not os.path.isabs(load) and not load.startswith(".") and len(words) <= 2 \
            and not os.path.isdir(words[0]):
        return
    _refuse(f"--load {load}: no such directory; give the directory a run saved to with --save (or --load and "
            f"--save the same directory to resume when it holds a checkpoint and start otherwise)")


def _check_resume_schedule(flags: argparse.Namespace, training: TrainingConfig) -> None:
    """Refuse a resume whose flags change ``--load``'s learning-rate schedule (a longer ``--train-iters``) unless
    ``--override-opt_param-scheduler`` or ``--use-checkpoint-opt_param-scheduler`` says which wins: the ranks'
    ``schedule.ResumableScheduler`` refuses it after the model is built; here it is the same scheduler, built on a
    one-parameter optimizer and handed the checkpoint's state. Megatron checkpoints only (a plain model's scheduler
    counts iterations its script chooses), and only the schedule of ``--train-iters`` or ``--train-samples``."""
    if not flags.load or flags.finetune or flags.no_load_optim or not (training.train_iters or training.train_samples):
        return
    from megatron_patch.checkpoint.format import _args_source, checkpoint_dir, checkpoint_format, read_args_state

    iteration = read_tracker(flags.load)
    weights = checkpoint_dir(flags.load, iteration) if isinstance(iteration, int) else None
    fmt = checkpoint_format(weights) if weights and os.path.isdir(weights) else None
    if fmt not in ("torch_dist", "torch"):
        return
    try:
        stored = read_args_state(_args_source(weights, fmt)).get("opt_param_scheduler")
    except Exception:  # noqa: BLE001  (a damaged checkpoint: the ranks' load names the file)
        return
    if not stored:
        return
    import torch

    from megatron_patch.errors import UserError
    from megatron_patch.training.schedule import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=training.lr or 0.0)
    try:
        build_scheduler(training, optimizer, training.train_iters, unit=training.global_batch_size
                        ).load_state_dict(stored)
    except UserError as error:
        _refuse(f"--load {flags.load}: {error}")


def _check_splits(flags: argparse.Namespace, config: RunConfig, family: str | None) -> None:
    """Refuse a ``--split`` that leaves a split asked for samples without data, from the ``.idx`` headers, as the
    ranks' ``datasets._check_splits`` does after the model is built: the default 969,30,1 leaves a small corpus's
    test split empty. The samples asked for are the Pretrainer's (``trainers.Pretrainer.train``). A BERT model's
    split counts documents, a GPT's sequences (no fewer), so a model the launcher cannot name is checked at the
    larger count and never refused wrongly."""
    if not flags.data_path or flags.mock_data or flags.sft or not (flags.task == "pretraining" or flags.user_script) \
            or (flags.user_script and not _names_prefixes(flags)):
        return
    from megatron_patch.data.data_path import check_data_path, read_index, split_ranges

    training, logging = config.training, config.logging
    gbs = training.global_batch_size
    evals = (training.train_iters // logging.eval_interval + 1) if logging.eval_interval and training.train_iters \
        else 0
    asked = [training.train_samples or (training.train_iters or 0) * gbs, evals * logging.eval_iters * gbs,
             logging.eval_iters * gbs]
    for prefix in check_data_path(flags.data_path):
        _, sequences, documents = read_index(prefix)
        count = documents if family == "bert" else sequences
        try:
            ranges = split_ranges(count, flags.split)
        except ValueError as error:
            _refuse(str(error))
        for name, share, samples in zip(("train", "valid", "test"), ranges, asked):
            if share is not None and samples and share[1] <= share[0]:
                _refuse(f"--split {flags.split} leaves the {name} split of {prefix} empty ({count} "
                        f"{'documents' if family == 'bert' else 'sequences'}) but {samples} {name} samples are "
                        f"asked for; give it a larger share (e.g. --split 90,5,5) or ask for none"
                        + (" (--eval-iters 0)" if name != "train" else ""))


def _environment(name: str, default: int) -> int:
    """torchrun's ``name`` (``distributed.env_int``), a wrong value refused in one line."""
    from megatron_patch.distributed import env_int

    try:
        return env_int(name, default)
    except ValueError as error:
        _refuse(str(error))


def run_config(flags: argparse.Namespace, world_size: int | None, *, layout: bool = True, this_machine: bool = True,
               launcher: bool = False) -> RunConfig:
    """The run of parsed ``flags`` on ``world_size`` processes (None: not known yet, an elastic world), refused in
    one line when anything is wrong: the flags' conflicts, the model against ``--load``'s record or the pretrained
    config.json, (``layout``) the layout against the model and the world, (``this_machine``) what this
    machine lacks and (``launcher``: the launcher's, once per node before any rank starts, not once per rank) the
    data's token ids against the tokenizer and ``--load``'s optimizer state against the layout (the ranks' load
    refuses the latter again, for runs the launcher did not start).

    Example::

        run_config(parse_flags(["--model-name", "gpt2-124m", "--tensor-model-parallel-size", "8"]), 8)
        # SystemExit: rapidformer: error: --num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8...
    """
    memory = _memory_mode(flags)
    distributed = flags.use_distributed_optimizer or memory in ("zero-1", "zero-2")
    positions = _check_pretrained_shape(flags)  # the flags as given, before --load or --model-name fill the others
    given = model_flag_values(flags)
    if positions is not None and "seq_length" not in given:
        given["seq_length"] = positions
    model = _loaded_model(flags) or ModelSpec(name=flags.model_name, family=flags.model_family,
                                              fields=tuple(given.items()))
    if launcher:
        _check_load_exists(flags)
    _check_data_path(flags, tokens=launcher)
    try:
        precision = precision_of(flags)
        notices, off = flag_notices(flags, precision)
        values = {**vars(flags), **off}
        built = model.build(model.family or "gpt") if model.described else None
        if flags.num_layers_per_virtual_pipeline_stage is not None and built is None:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs the model's --num-layers")
        parallel = parallel_config_from_args(argparse.Namespace(**values), built.num_layers if built else 0)
        data_parallel_size = None
        if layout:
            data_parallel_size = parallel.check_layout(
                built, world_size, flags.micro_batch_size, flags.global_batch_size,
                model.loaded and model.loaded.padded_vocab_size)
            if built is not None:
                parallel.check_options(built)
            if this_machine:
                parallel.check_backend(built)
            if launcher and model.loaded is not None and not (flags.finetune or flags.no_load_optim):
                _check_resume_layout(flags, parallel, data_parallel_size, distributed)
        config = from_flags(
            RunConfig, values, local_rank=_environment("LOCAL_RANK", flags.local_rank or 0),
            rank=_environment("RANK", 0), world_size=world_size, model=model, parallel=parallel,
            # SFT's loss is per trained token over the global batch, so that packing changes no token's weight
            # (DPO's, per preference pair).
            training=from_flags(TrainingConfig, values, data_parallel_size=data_parallel_size,
                                memory_optimization=memory, use_distributed_optimizer=distributed,
                                calculate_per_token_loss=flags.calculate_per_token_loss or flags.sft
                                or flags.dpo),
            data=from_flags(DataConfig, values, seq_length=model.value("seq_length"),
                            dataset_path=flags.dataset_path or (flags.data_path[0] if flags.data_path else None),
                            dataset_name=flags.dataset_name or flags.data_name),
            checkpointing=from_flags(CheckpointConfig, values), logging=from_flags(LoggingConfig, values),
            lora=from_flags(LoraConfig, values),
            tokenizer_type=flags.tokenizer_type,
            tokenizer_options=tuple(sorted((k, v) for k, v in tokenizer_options(flags).items() if v is not None)),
            flag_notices=tuple(notices))
    except ValueError as error:  # a section's, the layout's or the model's refusal, naming the flags
        _refuse(str(error))
    if launcher and (config.data.sft or config.data.dpo):
        _check_sft_run(config)
    if launcher and layout:
        _check_resume_schedule(flags, config.training)
        _check_splits(flags, config, built.family if built else None)
    return config


def _check_sft_run(config: RunConfig) -> None:
    """An ``--sft`` or ``--dpo`` run's data prepared and packed before any rank starts (training/sft.py), wrong
    input refused."""
    from megatron_patch.errors import UserError
    from megatron_patch.tokenizer.registry import build_tokenizer
    from megatron_patch.training.sft import check_sft_run

    try:
        prefixes = check_sft_run(config)
        vocab = build_tokenizer(config.tokenizer_type, **dict(config.tokenizer_options)).vocab_size
    except (UserError, OSError, ValueError) as error:
        _refuse(str(error))
    for prefix, largest in prefixes.items():
        if largest is not None and largest >= vocab:
            _refuse(f"--data-path {prefix}: token id {largest} is beyond the {vocab} tokens of --tokenizer-type "
                    f"{config.tokenizer_type}; prepare the data with the tokenizer the run uses")


def parse_flags(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as given, unknown flags refused with their names; nothing changes it afterwards.

    Example::

        >>> parse_flags(["--lr", "0.1", "--lr-decay"])
        Traceback (most recent call last):
        SystemExit: rapidformer: error: unrecognized arguments: --lr-decay (--lr-decay: did you mean --lr-decay-style?)
        >>> parse_flags(["--lr", "0.1", "--zzz"])
        Traceback (most recent call last):
        SystemExit: rapidformer: error: unrecognized arguments: --zzz (see rapidformer --help)
    """
    parser = build_parser()
    flags, unknown = parser.parse_known_args(argv)
    if refusal(unknown):
        _refuse(refusal(unknown))
    if unknown:
        meant = did_you_mean(unknown, option_strings(parser))
        _refuse(f"unrecognized arguments: {' '.join([item for item in unknown if item.startswith('-')] or unknown)}"
                f"{meant or ' (see rapidformer --help)'}")
    return flags


def parse_args(argv: list[str] | None = None) -> ArgsView:
    """The view of ``argv``'s run on a world not known yet, its layout unchecked (for tools that need neither).

    Example::

        >>> parse_args(["--zero-1-memory-optimization", "--zero-3-memory-optimization"])
        Traceback (most recent call last):
        SystemExit: rapidformer: error: --zero-1-memory-optimization and --zero-3-memory-optimization conflict; ...
    """
    return args_view(run_config(parse_flags(argv), None, layout=False))


# The launcher's parse in a rank process: (argv, (RunConfig, args)); see parse_run.
_HANDED_OVER: tuple[tuple[str, ...], tuple[RunConfig, ArgsView]] | None = None


def parse_run(argv: list[str], world_size: int | None = None, *, hand_over: bool = False
              ) -> tuple[RunConfig, ArgsView]:
    """``(RunConfig, args)`` of ``argv`` on ``world_size`` processes (default: torchrun's ``WORLD_SIZE``).

    Example::

        config, args = parse_run(sys.argv[1:])
        config.training.global_batch_size == args.global_batch_size    # True

    ``hand_over=True`` (the launcher's rank entry) keeps the result for the engine the task or user script
    creates with the same ``argv``, so a rank parses its flags once.
    """
    global _HANDED_OVER
    key = tuple(argv)
    if _HANDED_OVER is not None and _HANDED_OVER[0] == key and world_size is None:
        return _HANDED_OVER[1]
    config = run_config(parse_flags(argv), _environment("WORLD_SIZE", 1) if world_size is None else world_size)
    parsed = (config, args_view(config))
    if hand_over:
        _HANDED_OVER = (key, parsed)
    return parsed
