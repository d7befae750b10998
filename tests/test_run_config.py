"""
    python -m pytest -q tests/test_run_config.py

The typed run configuration (training/config.py): the flags are parsed once per process (in a rank, the engine
the task or the user script creates takes the launcher's parse), everything below the entry point reads the frozen
``RunConfig`` (no ``argparse.Namespace`` there; ``get_args()`` is the user scripts' view of the same values), and
the derived quantities match Megatron-LM's arithmetic.
"""

import ast
import dataclasses
import pathlib

import pytest

from megatron_patch.testing import run_on_ranks

TRAINING = pathlib.Path(__file__).resolve().parent.parent / "megatron_patch" / "training"
# The entry points, which parse flags into the RunConfig and keep Megatron-LM's view of them for user scripts; and
# `megatron-patch checkpoint reshard`, a command of its own that reads the Megatron-LM args a checkpoint stores.
ENTRY_POINTS = {"arguments.py", "engine.py", "launcher.py", "plan.py", "reshard.py"}

USER_SCRIPT = """
from rapidformer import RapidformerEngine, get_args

engine = RapidformerEngine()
assert get_args() is engine.args and engine.config.training.micro_batch_size == 2
"""


def parses_per_rank(rank, world_size, script):
    import argparse
    import sys
    from unittest import mock

    from megatron_patch.training import arguments, launcher, tasks

    calls = []
    parse = argparse.ArgumentParser.parse_known_args

    def counted(self, *args, **kwargs):
        if self.prog == "rapidformer":
            calls.append(self.prog)
        return parse(self, *args, **kwargs)

    tasks_seen = []
    saved = sys.argv, sys.modules["__main__"], list(sys.path)
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", counted), \
                mock.patch.object(tasks, "run_task", lambda engine: tasks_seen.append(engine.config.task)):
            launcher._run_rank(["--user-script", script, "--micro-batch-size", "2"])
            user_script = len(calls)
            calls.clear()
            launcher._run_rank(["--task", "pretraining", "--micro-batch-size", "2", "--mock-data"])
            task = len(calls)
    finally:
        sys.argv, sys.modules["__main__"], sys.path[:] = saved
        arguments._HANDED_OVER = None
    return user_script, task, tasks_seen


def test_a_rank_parses_its_flags_once(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(USER_SCRIPT)
    [(user_script, task, tasks_seen)] = run_on_ranks(parses_per_rank, 1, args=(str(script),))
    assert (user_script, task) == (1, 1)
    assert tasks_seen == ["pretraining"]


def _reads_of_args(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"
            or isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name)
            and node.value.id == "self"]


def test_no_namespace_below_the_entry_point():
    found = {}
    for path in sorted(TRAINING.rglob("*.py")):
        if path.name in ENTRY_POINTS:
            continue
        tree = ast.parse(path.read_text())
        imports = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and any(alias.name == "argparse" for alias in n.names)]
        reads = _reads_of_args(tree)
        if imports or reads:
            found[str(path.relative_to(TRAINING))] = imports + reads
    # trainers.py sets self.args once, for the user's hooks; nothing of ours reads it.
    assert list(found) == ["trainers.py"] and len(found["trainers.py"]) == 1, found


def test_the_configuration_is_frozen_and_derived_once():
    from megatron_patch.training.arguments import parse_run

    config, args = parse_run(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
                              "--tensor-model-parallel-size", "2", "--rampup-batch-size", "4", "4", "48",
                              "--train-samples", "256"], world_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.lr = 1.0
    # 4 ranks / TP 2 = 2 data-parallel ranks; 16 / (2 x 2) = 4 microbatches at the full batch.
    assert (config.training.data_parallel_size, config.training.num_microbatches) == (2, 4)
    # Megatron-LM's update_train_iters: the ramp-up's iterations (4,4,4,4,8,8,12,12 = 56 samples, the ramp lasting
    # 48 samples), then (256 - 56) // 16 = 12 full ones.
    assert config.training.train_iters == 8 + 12
    assert (args.train_iters, args.num_microbatches, args.data_parallel_size) == (20, 4, 2)
    assert config.data.seq_length == 32 and config.model.build("gpt", 100).num_layers == 4


def test_a_bad_batch_is_refused_before_any_process_group():
    from megatron_patch.training.arguments import parse_run

    with pytest.raises(SystemExit, match="--global-batch-size 6 is not divisible by --micro-batch-size 2 x "
                                         "data-parallel size 2"):
        parse_run(["--micro-batch-size", "2", "--global-batch-size", "6"], world_size=2)


@pytest.mark.parametrize("flags, precision", [
    ([], "fp32"), (["--bf16"], "bf16"), (["--fp16"], "fp16"), (["--mixed-precision"], "fp16"),
    (["--mixed-precision", "--bf16"], "bf16"), (["--fp16", "--bf16"], None),
])
def test_precision_is_decided_once_and_a_conflict_refused_at_its_flags(flags, precision):
    """ParallelConfig holds one precision field, so the --fp16/--bf16 conflict that its two booleans were checked
    for (test_model_config's old case) is refused where the flags are read, naming both."""
    from megatron_patch.training.arguments import parse_run

    if precision is None:
        with pytest.raises(SystemExit, match="--fp16 and --bf16 conflict"):
            parse_run(flags, world_size=1)
    else:
        config, args = parse_run(flags, world_size=1)
        assert (config.parallel.precision, args.bf16, args.fp16) == (precision, precision == "bf16",
                                                                    precision == "fp16")


# What get_args() answered before the RunConfig became the only source (the parsed Namespace, validated in place),
# and answers now from it: every flag's destination, Megatron-LM's derived names, and the model switches under
# Megatron-LM's names (swiglu, ..., kept before under a private _switch_ name), which model_config_from_args reads.
ATTRIBUTES = """
adam_beta1 adam_beta2 adam_eps async_save attention_backend attention_dropout bert_layernorm_style bf16
calculate_per_token_loss checkpoint_activations checkpoint_info ckpt_format clip_grad compile_backend
context_parallel_size create_attention_mask_in_dataloader cross_entropy_loss_fusion data_cache_path data_impl data_name
data_parallel_size data_path dataset_name dataset_path decoupled_lr decoupled_min_lr distributed_timeout_minutes
empty_unused_memory_level eod_mask_loss epochs eval_interval eval_iters exit_duration_in_mins
exit_on_missing_checkpoint exit_signal_handler expert_model_parallel_size expert_tensor_parallel_size ffn_hidden_size
finetune flag_notices fp16 fp8_amax_compute_algo fp8_amax_history_len fp8_format fp8_param_gather
fsdp_memory_optimization fused_kernels global_batch_size grad_reduce_in_bf16 group_query_attention hidden_dropout
hidden_size init_method_std initial_loss_scale keep_last_k kv_channels layernorm_epsilon load load_fallback local_rank
log_dir log_interval log_throughput loss_scale lr lr_decay_iters lr_decay_samples lr_decay_style lr_warmup_fraction
lr_warmup_iters lr_warmup_samples make_vocab_size_divisible_by manual_gc manual_gc_eval manual_gc_interval mask_prob
max_bad_steps max_position_embeddings memory_optimization merge_file micro_batch_size min_lr mixed_precision
mmap_bin_files mmap_warmup mock_data model_family model_name moe_aux_loss_coeff moe_expert_capacity_factor
moe_ffn_hidden_size moe_grouped_gemm moe_router_load_balancing_type moe_router_topk
moe_shared_expert_intermediate_size moe_token_dispatcher_type moe_token_drop_policy no_load_optim no_load_rng
no_verify_checksums normalization nproc_per_node num_attention_heads num_layers num_layers_per_virtual_pipeline_stage
num_microbatches num_moe_experts num_query_groups num_workers onnx_runtime_training overlap_grad_reduce
overlap_param_gather params_dtype pipeline_model_parallel_size position_embedding_type pretrained_model_name_or_path
profile profile_ranks profile_step_end profile_step_start rampup_batch_size rank recompute_granularity
recompute_method recompute_num_layers reset_attention_mask reset_position_ids rope_scaling_factor rotary_base
rotary_percent save save_interval seed seq_length sequence_parallel short_seq_prob split task
tensor_model_parallel_size tensorboard_dir tiktoken_pattern tokenizer_model tokenizer_type train_iters train_samples
transformer_impl use_distributed_optimizer use_mcore_models user_script virtual_pipeline_model_parallel_size
vocab_extra_ids vocab_file vocab_size weight_decay world_size zero_1_memory_optimization zero_2_memory_optimization
zero_3_memory_optimization
swiglu openai_gelu disable_bias_linear add_qkv_bias qk_layernorm use_rope_scaling untie_embeddings_and_output_weights
bert_no_binary_head apply_layernorm_1p moe_shared_expert_gate moe_router_pre_softmax moe_pad_expert_input_to_capacity
""".split()
ROOT = TRAINING.parent.parent
RECIPES = ["examples/gpt/run_pretrain_gpt.sh", "examples/bert/run_pretrain_bert.sh",
           "examples/bert/run_finetune_bert.sh"]


def _recipe_flags(recipe: str, tmp_path) -> list[str]:
    """The launcher flags a recipe runs, as its --dry-run prints them."""
    import os
    import shlex
    import subprocess
    import sys

    result = subprocess.run(["bash", str(ROOT / recipe), "--dry-run", "--cpu", "--output-dir", str(tmp_path)],
                            env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    words = shlex.split(result.stdout.split("the command it would run:\n", 1)[1].splitlines()[0][2:])
    return words[words.index("megatron_patch.training.launcher") + 1:]


def _example_flag_sets() -> list[tuple[str, list[str]]]:
    """Megatron-LM's example scripts' flags (tests/data/megatron_lm_example_flags.json), without --tensorboard-dir
    where tensorboard is not installed (refused then, by name)."""
    import importlib.util
    import json

    sets = json.loads((ROOT / "tests" / "data" / "megatron_lm_example_flags.json").read_text())["scripts"]
    found = importlib.util.find_spec("tensorboard") is not None
    return [(f"{script} {variant}",
             [w for i, w in enumerate(argv) if found or "--tensorboard-dir" not in argv[i - 1:i + 1]])
            for script, variants in sets.items() for variant, argv in variants.items()]


def test_no_namespace_changes_after_parsing_and_the_view_is_read_only(tmp_path):
    """Every recipe's and every Megatron-LM example's flags: the parsed Namespace is what the command line said
    after the RunConfig is built from it, and get_args()'s view refuses to be written."""
    import copy

    from megatron_patch.training.arguments import args_view, parse_flags, run_config

    commands = [(recipe, _recipe_flags(recipe, tmp_path / str(i)), True) for i, recipe in enumerate(RECIPES)]
    # Megatron-LM's examples are for their clusters (bert_340m's 24 layers do not split into its 16 stages).
    commands += [(name, argv, False) for name, argv in _example_flag_sets()]
    for name, argv, layout in commands:
        flags = parse_flags(argv)
        given = copy.deepcopy(vars(flags))
        config = run_config(flags, None, layout=layout)
        assert vars(flags) == given, name
        args = args_view(config)
        assert set(ATTRIBUTES) <= set(vars(args)), (name, set(ATTRIBUTES) - set(vars(args)))
        for write in (lambda: setattr(args, "lr", 1.0), lambda: delattr(args, "lr"),
                      lambda: setattr(args, "new_name", 1)):
            with pytest.raises(AttributeError, match="read-only view"):
                write()
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.checkpointing.save = "elsewhere"


def test_get_args_holds_the_runs_values_under_megatron_lms_names():
    """The view says what the run does: the named model's fields, the switches its configuration sets, the
    precision, what this machine turns off, the derived batch arithmetic."""
    import torch

    from megatron_patch.model.config import get_model_config
    from megatron_patch.training.arguments import parse_run

    config, args = parse_run(["--model-name", "tiny-llama", "--bf16", "--micro-batch-size", "2", "--global-batch-size",
                              "8", "--sequence-parallel", "--zero-1-memory-optimization", "--profile"], world_size=2)
    llama = get_model_config("tiny-llama")
    assert (args.num_layers, args.hidden_size, args.seq_length) == (llama.num_layers, llama.hidden_size,
                                                                     llama.seq_length)
    assert args.swiglu and args.untie_embeddings_and_output_weights and not args.add_qkv_bias
    assert (args.bf16, args.fp16, args.params_dtype, config.parallel.params_dtype) == (True, False, "bf16",
                                                                                         torch.bfloat16)
    assert args.zero_1_memory_optimization and args.use_distributed_optimizer and not args.zero_2_memory_optimization
    assert args.sequence_parallel is False and config.parallel.sequence_parallel is False  # TP=1: turned off
    assert args.profile is torch.cuda.is_available() and args.profile is config.training.profile
    assert (args.data_parallel_size, args.num_microbatches, args.world_size) == (2, 2, 2)


@pytest.mark.parametrize("layout", [["--num-layers-per-virtual-pipeline-stage", "1"],
                                    ["--virtual-pipeline-model-parallel-size", "2", "--checkpoint-activations",
                                     "--fp16", "--add-qkv-bias"]])
def test_a_user_script_rebuilds_the_runs_model_and_layout_from_get_args(layout):
    """Rapidformer's Megatron trainer template builds its model with model_config_from_args(get_args()) and
    parallel_config_from_args(get_args(), layers): from the view they give the run's own."""
    from megatron_patch.model import model_config_from_args, parallel_config_from_args
    from megatron_patch.training.arguments import parse_run

    config, args = parse_run(["--model-name", "tiny-llama", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                              *layout], 2)
    model = config.model.build("gpt", 128)
    assert model_config_from_args(args, vocab_size=128) == model
    assert parallel_config_from_args(args, model.num_layers) == config.parallel


def test_the_plan_and_the_trainers_resolve_the_model_through_one_function():
    """For every named model and a few layouts, the dry-run plan and the trainers' model_config_and_vocab each ask
    ModelSpec.model_and_vocab once and get the same model and padded vocabulary, or both refuse the layout alike."""
    from unittest import mock

    from megatron_patch.model.config import list_model_configs
    from megatron_patch.tokenizer.registry import build_tokenizer
    from megatron_patch.training.arguments import parse_run
    from megatron_patch.training.config import ModelSpec
    from megatron_patch.training.models import model_config_and_vocab
    from megatron_patch.training.plan import build_plan

    tokenizer = build_tokenizer("NullTokenizer", vocab_size=1000)
    layouts = [[], ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
               ["--tensor-model-parallel-size", "4", "--sequence-parallel"]]
    resolved = 0
    for name in list_model_configs():
        for layout in layouts:
            argv = ["--model-name", name, "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", *layout]
            with mock.patch.object(ModelSpec, "model_and_vocab", autospec=True,
                                   side_effect=ModelSpec.model_and_vocab) as resolve:
                try:
                    plan = build_plan(["--nproc-per-node", "4", *argv])
                except SystemExit as refused:
                    with pytest.raises(SystemExit) as again:
                        parse_run(argv, world_size=4)
                    assert str(again.value) == str(refused)
                    continue
                config, _ = parse_run(argv, world_size=4)
                trained = model_config_and_vocab(config, tokenizer, plan.model.family)
            assert resolve.call_count == 2, (name, layout)
            assert (plan.model, plan.padded_vocab) == trained, (name, layout)
            resolved += 1
    assert resolved >= len(list_model_configs())
