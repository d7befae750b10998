"""The run_*.sh launch recipes: their --dry-run plan against arithmetic done here from first principles, each
recipe training a tiny model on 2 CPU processes until its loss falls, the command they print being the one that
runs, and flag errors that name the flag.

    python -m pytest -q -p no:cacheprovider tests/test_run_scripts.py
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
from seed_scripts.assets import rapidformer_assets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt", "run_pretrain_gpt.sh")
BERT = os.path.join(ROOT, "examples", "bert", "run_pretrain_bert.sh")
FINETUNE = os.path.join(ROOT, "examples", "bert", "run_finetune_bert.sh")
# The user script each recipe launches.
USER_SCRIPT = {GPT: "examples/gpt/pretrain_gpt.py", BERT: "examples/bert/pretrain_bert.py",
               FINETUNE: "examples/bert/finetune_classification.py"}
GIB = 2 ** 30


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _environment(**env) -> dict:
    """This process's environment with the launch variables only as ``env`` gives them."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    return {**environment, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}


def _recipe(script, *flags, cwd, timeout=240, **env):
    """Run a recipe with bash; (exit status, stdout + stderr)."""
    result = subprocess.run(["bash", script, *flags], cwd=cwd, env=_environment(**env), capture_output=True,
                            text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def _field(output: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}: (.*)$", output, re.M)
    assert match, f"no '{name}:' line in\n{output}"
    return match.group(1)


def _command_words(line: str) -> list[str]:
    """A printed ``+ VAR=value ... command`` line as the shell splits it, the environment assignments dropped."""
    words = shlex.split(line[2:])
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words.pop(0)
    return words


def _number(text: str) -> float:
    return float(re.match(r"[0-9][0-9,.]*", text).group(0).replace(",", ""))


# ------------------------------------------------------------------------------------------------------------
# The --dry-run plan of a documented real configuration
# ------------------------------------------------------------------------------------------------------------

def _llama2_7b_parameters(vocab: int) -> dict:
    """LLaMA-2 7B from its published shape: 32 layers, hidden 4096, SwiGLU MLP 11008, 32 heads (no GQA), RMSNorm,
    no biases, untied output layer."""
    h, ffn, layers = 4096, 11008, 32
    layer = 4 * h * h + 3 * h * ffn + 2 * h  # q, k, v, o; gate, up, down; two RMSNorm weights
    return {"layer": layer, "layers": layers, "embedding": vocab * h, "output": vocab * h, "final_norm": h,
            "total": layers * layer + h + 2 * vocab * h}


def test_llama2_7b_parameter_count_is_the_published_one():
    # The reference count of meta-llama/Llama-2-7b-hf (32,000-token vocabulary, unpadded).
    assert _llama2_7b_parameters(32000)["total"] == 6_738_415_616


@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_dry_run_plans_llama2_7b_on_2_nodes_of_8_gpus_tp4_pp2(tmp_path, distributed_optimizer):
    nnodes, gpus, tp, pp, micro, global_batch = 2, 8, 4, 2, 1, 128
    flags = ["--dry-run", "--model-size", "llama2-7b", "--nproc-per-node", str(gpus), "--tp", str(tp), "--pp",
             str(pp), "--precision", "bf16", "--micro-batch-size", str(micro), "--global-batch-size",
             str(global_batch)]
    seq = 4096  # LLaMA-2's context
    iterations = math.ceil(10 ** 9 / (global_batch * seq))
    # --train-tokens costs one more start of Python (the conversion), so one case asks for the iterations.
    flags += ["--distributed-optimizer", "--train-tokens", str(10 ** 9)] if distributed_optimizer else \
        ["--train-iters", str(iterations)]
    code, output = _recipe(GPT, *flags, cwd=tmp_path, timeout=120, NNODES=str(nnodes))
    assert code == 0, output

    world = nnodes * gpus
    dp = world // (tp * pp)
    assert dp == 2
    assert _number(_field(output, "world size")) == world
    assert _field(output, "layout").startswith(f"TP {tp} x CP 1 x DP {dp} x PP {pp} ")
    accumulation = global_batch // (micro * dp)
    assert _number(_field(output, "gradient accumulation steps")) == accumulation == 64
    assert _number(_field(output, "train iterations")) == iterations

    # Megatron-LM pads the vocabulary to a multiple of 128 x TP so each TP shard of the embedding is even.
    vocab = math.ceil(32000 / (128 * tp)) * 128 * tp
    assert vocab == 32256
    p = _llama2_7b_parameters(vocab)
    assert _number(_field(output, "parameters")) == p["total"]
    # Megatron-core's rank order puts pipeline stages outermost: stage s is ranks s*8 .. s*8+7, i.e. node s.
    per_stage = p["layers"] // pp * p["layer"]
    first, last = per_stage + p["embedding"], per_stage + p["final_norm"] + p["output"]
    stage0, stage1 = _field(output, "pipeline stage 0"), _field(output, "pipeline stage 1")
    assert stage0.startswith("ranks 0-7 (node 0), layers 0-15 + embedding")
    assert stage1.startswith("ranks 8-15 (node 1), layers 16-31 + final norm + output layer")
    assert _number(stage0.rsplit(": ", 1)[1]) == first
    assert _number(stage1.rsplit(": ", 1)[1]) == last
    per_gpu = max(first, last) / tp
    assert _number(_field(output, "parameters per GPU")) == round(per_gpu)
    assert _field(output, "tensor-parallel groups").startswith("[0, 1, 2, 3] [4, 5, 6, 7]")

    # Bytes per parameter with Adam in mixed precision: bf16 weights 2, fp32 gradients 4, fp32 master weights and
    # two moments 12, the last sharded over DP by the distributed optimizer.
    weights, gradients, optimizer = 2, 4, 12 / dp if distributed_optimizer else 12
    assert _number(_field(output, "bytes per parameter")) == weights + gradients + optimizer
    memory = _field(output, "memory per GPU")
    expected = [per_gpu * b / GIB for b in (weights + gradients + optimizer, weights, gradients, optimizer)]
    found = [float(x) for x in re.findall(r"(\d+\.\d+)", memory)[:4]]
    assert found == pytest.approx(expected, abs=0.006)  # printed with 2 decimals
    assert "activations" in memory and "not included" in memory

    # The dry run ends with the command it would run: one launcher call with the layout flags.
    command = _command_words(output.split("the command it would run:\n", 1)[1].splitlines()[0])
    assert command[:3] == [sys.executable, "-m", "megatron_patch.training.launcher"]
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--train-iters", iterations)):
        assert command[command.index(flag) + 1] == str(value)


@pytest.mark.parametrize("flags, message", [
    (["--model-name", "gpt2-124m", "--nproc-per-node", "8", "--tensor-model-parallel-size", "8"],
     "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8"),
    (["--model-name", "gpt2-124m", "--nproc-per-node", "8", "--pipeline-model-parallel-size", "8"],
     "--num-layers 12 is not divisible by --pipeline-model-parallel-size 8"),
    (["--model-name", "gpt2-124m", "--nproc-per-node", "8", "--pipeline-model-parallel-size", "2",
      "--virtual-pipeline-model-parallel-size", "4"],
     "6 layers of a pipeline stage are not divisible by --virtual-pipeline-model-parallel-size 4"),
    (["--model-name", "gpt2-124m", "--nproc-per-node", "6", "--tensor-model-parallel-size", "4"],
     "world size 6 is not divisible by --tensor-model-parallel-size"),
    (["--model-name", "gpt2-124m", "--nproc-per-node", "8", "--micro-batch-size", "2", "--global-batch-size", "24"],
     "--global-batch-size 24 is not divisible by --micro-batch-size 2 x data-parallel size 8"),
])
def test_plan_refuses_a_layout_naming_the_flag(flags, message):
    from megatron_patch.training import plan

    with pytest.raises(SystemExit) as error:
        plan.main(["--nnodes", "1", *flags])
    assert message in str(error.value)


def test_plan_of_tied_embeddings_puts_a_copy_on_the_last_stage():
    """GPT-2 ties its output layer to the embedding; with PP > 1 the last stage keeps a copy (megatron-core), with
    PP = 1 there is none. Learned positions go with the first stage."""
    from megatron_patch.training.plan import build_plan

    h, layers, positions = 768, 12, 1024
    vocab = math.ceil(50257 / 128) * 128
    # q/k/v and output projections 4h^2 + 4h, MLP h->4h->h 8h^2 + 5h, two LayerNorms (weight and bias) 4h
    layer = 12 * h * h + 13 * h
    single = build_plan(["--model-name", "gpt2-124m", "--nproc-per-node", "1"])
    assert single.stages[0].parameters == layers * layer + vocab * h + positions * h + 2 * h
    piped = build_plan(["--model-name", "gpt2-124m", "--nproc-per-node", "2", "--pipeline-model-parallel-size", "2",
                        "--virtual-pipeline-model-parallel-size", "2"])
    assert piped.stages[0].layers == [0, 1, 2, 6, 7, 8]  # chunks 0 and 2 of 3 layers each
    assert piped.stages[0].parameters == 6 * layer + vocab * h + positions * h
    assert piped.stages[1].parameters == 6 * layer + 2 * h + vocab * h


# ------------------------------------------------------------------------------------------------------------
# Flag errors name the flag
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--tpp", "2"], "unknown flag '--tpp'"),
    (["--tp"], "--tp needs a value"),
    (["--pp", "two"], "--pp must be an integer >= 1, got 'two'"),
    (["--precision", "fp8"], "--precision must be one of fp16 bf16 fp32, got 'fp8'"),
    (["--recompute", "some"], "--recompute must be one of selective full none, got 'some'"),
    (["--train-iters", "5", "--train-tokens", "100"], "give --train-iters or --train-tokens, not both"),
])
def test_a_bad_flag_names_itself(tmp_path, flags, message):
    code, output = _recipe(GPT, *flags, cwd=tmp_path, timeout=30)
    assert code == 2 and message in output, output


def test_multi_node_launch_needs_the_rendezvous_address(tmp_path):
    code, output = _recipe(GPT, "--cpu", cwd=tmp_path, timeout=30, NNODES="2", NODE_RANK="1")
    assert code == 2 and "MASTER_ADDR" in output and "MASTER_PORT" in output, output
    code, output = _recipe(GPT, "--cpu", cwd=tmp_path, timeout=30, NNODES="2", NODE_RANK="2")
    assert code == 2 and "NODE_RANK" in output, output


def test_help_lists_the_named_flags(tmp_path):
    code, output = _recipe(GPT, "--help", cwd=tmp_path, timeout=30)
    assert code == 0
    for flag in ("--model-size", "--precision", "--tp", "--pp", "--vpp", "--sp", "--distributed-optimizer",
                 "--recompute", "--save-interval", "--data-path", "--load", "--train-iters", "--train-tokens",
                 "--output-dir", "--cpu", "--dry-run", "--nproc-per-node", "NNODES", "MASTER_ADDR"):
        assert flag in output


@pytest.mark.parametrize("described", [True, False], ids=["described", "tracker-only"])
def test_a_rerun_resumes_from_its_output_directory(tmp_path, described):
    """A recipe rerun on an output directory holding a checkpoint resumes from it, with the model the checkpoint
    describes when it has a description; the package names both files, which common.sh does not spell."""
    from megatron_patch.checkpoint.format import (
        ARGS_FILE, TRACKER_FILE, CheckpointInfo, write_args_file, write_tracker,
    )
    from megatron_patch.model.config import get_model_config

    checkpoints = tmp_path / "out" / "checkpoints"
    checkpoints.mkdir(parents=True)
    write_tracker(str(checkpoints), 1)
    if described:
        write_args_file(str(checkpoints), CheckpointInfo("torch_dist", get_model_config("tiny-llama"), 128))
    code, output = _recipe(GPT, "--dry-run", "--cpu", "--model-size", "tiny-gpt2", "--output-dir",
                           str(tmp_path / "out"), cwd=tmp_path, timeout=120)
    assert code == 0, output
    assert f"resuming from {checkpoints} " in output
    assert (f"the model comes from {checkpoints / ARGS_FILE}; --model-size is not passed" in output) == described
    command = _command_words(next(line for line in output.splitlines() if line.startswith("+ ")))
    assert command[command.index("--load") + 1] == str(checkpoints)
    assert ("--model-name" in command) != described
    with open(os.path.join(ROOT, "run_scripts", "common.sh")) as f:
        recipe = f.read()
    assert TRACKER_FILE not in recipe and ARGS_FILE not in recipe


# ------------------------------------------------------------------------------------------------------------
# Every recipe trains a tiny model on CPU processes (BERT ones at 1 and 2); the printed command is what runs
# ------------------------------------------------------------------------------------------------------------

def _losses(log: str, name: str = "lm loss") -> list[float]:
    """The logged losses: a language model's "lm loss", a sequence classifier's "classification loss"."""
    return [float(x) for x in re.findall(rf"\| {name}: ([0-9.E+-]+)", log)]


def _printed_commands(log: str) -> tuple[list[str], list[str]]:
    """The recipe's printed command and the torchrun command the launcher printed for it."""
    lines = [line for line in log.splitlines() if line.startswith("+ ")]
    return _command_words(lines[0]), _command_words(next(line for line in lines if "torch.distributed.run" in line))


def _trains(script, tmp_path, *flags, recipe_name, nproc="2", loss_name="lm loss"):
    # A recipe without its user script is a defect of the repository, not a reason to skip.
    assert os.path.isfile(os.path.join(ROOT, USER_SCRIPT[script])), \
        f"{USER_SCRIPT[script]}, which {os.path.basename(script)} runs, does not exist"
    out = tmp_path / "out"
    code, output = _recipe(script, "--cpu", "--nproc-per-node", nproc, "--output-dir", str(out), *flags,
                           cwd=tmp_path)
    assert code == 0, output[-5000:]
    log = (out / "logs" / f"{recipe_name}_node0.log").read_text()
    losses = _losses(log, loss_name)
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").is_file()
    return output, log


def test_run_pretrain_gpt_trains_with_tp2_and_runs_the_command_it_prints(assets, tmp_path):
    flags = ["--tp", "2", "--seq-length", "32", "--data-path", assets.gpt_prefix,
             "--vocab-file", assets.gpt_options["vocab_file"], "--merge-file", assets.gpt_options["merge_file"],
             "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "16", "--lr", "3e-3",
             "--", "--log-interval", "2", "--split", "98,2,0"]
    code, dry = _recipe(GPT, "--dry-run", "--cpu", "--nproc-per-node", "2", "--output-dir", str(tmp_path / "out"),
                        *flags, cwd=tmp_path, timeout=120)
    assert code == 0, dry
    assert _number(_field(dry, "world size")) == 2 and _field(dry, "layout").startswith("TP 2 x CP 1 x DP 1 x PP 1")
    would_run = dry.split("the command it would run:\n", 1)[1].splitlines()[0]

    output, log = _trains(GPT, tmp_path, *flags, recipe_name="pretrain_gpt")
    printed = next(line for line in output.splitlines() if line.startswith("+ "))
    assert printed == would_run  # --dry-run shows exactly what a run runs
    assert printed.startswith("+ CUDA_VISIBLE_DEVICES='' ")  # --cpu hides the GPUs from torch
    recipe, torchrun = _printed_commands(log)
    assert recipe[:4] == [sys.executable, "-m", "megatron_patch.training.launcher", "--user-script"]
    # The launcher ran that command: each rank got its flags (the process count went to torchrun).
    rank_argv = torchrun[torchrun.index("--rank-entry") + 1:]
    nproc = recipe.index("--nproc-per-node")
    assert rank_argv == recipe[3:nproc] + recipe[nproc + 2:]
    assert "--nproc-per-node=2" in torchrun
    # What ran is what was printed: the --cpu default model (tiny-gpt2: 2 layers, hidden 64) at --tp 2.
    stored = json.loads((tmp_path / "out" / "checkpoints" / "megatron_patch_args.json").read_text())
    assert recipe[recipe.index("--model-name") + 1] == "tiny-gpt2"
    assert stored["tensor_model_parallel_size"] == 2
    assert (stored["model_config"]["num_layers"], stored["model_config"]["hidden_size"]) == (2, 64)


def _saved_optimizer_state(checkpoints) -> dict:
    """The optimizer's non-tensor state in the last torch_dist checkpoint under ``checkpoints`` (its common.pt).

    Which optimizer ran shows there, not in the flags: megatron-core's DistributedOptimizer records how it sharded
    its parameter state (``param_state_sharding_type``, ``DistributedOptimizer.sharded_state_dict`` in core
    0.16.1), while its plain Float16/FP32 optimizers save torch's ``param_groups`` and ``state`` and no such entry.
    The tensors alone need not tell them apart: the ``fully_reshardable`` format saves the same keys as the plain
    optimizer, so that either loads the other's checkpoint.
    """
    from megatron.core import dist_checkpointing

    from megatron_patch.checkpoint.format import checkpoint_dir, read_tracker

    path = checkpoint_dir(str(checkpoints), read_tracker(str(checkpoints)))
    return dist_checkpointing.load_common_state_dict(path)["optimizer"]


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_run_pretrain_bert_trains_with_the_distributed_optimizer(assets, tmp_path, nproc):
    _trains(BERT, tmp_path, "--distributed-optimizer", "--seq-length", "32", "--data-path", assets.bert_prefix,
            "--vocab-file", assets.vocab_file, "--micro-batch-size", "8", "--global-batch-size", "16",
            "--train-iters", "16", "--lr", "3e-3", "--", "--log-interval", "2", "--split", "98,2,0",
            recipe_name="pretrain_bert", nproc=nproc)
    saved = _saved_optimizer_state(tmp_path / "out" / "checkpoints")
    assert saved.get("param_state_sharding_type") == "dp_reshardable", \
        f"the checkpoint's optimizer state {sorted(saved)} is not the distributed optimizer's"


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_run_finetune_bert_trains_a_classifier(assets, tmp_path, nproc):
    output, log = _trains(FINETUNE, tmp_path, "--seq-length", "32", "--data-path", assets.glue_dir,
                          "--data-name", "mrpc", "--vocab-file", assets.vocab_file, "--micro-batch-size", "8",
                          "--global-batch-size", "16", "--epochs", "2", "--lr", "2e-3", "--",
                          "--log-interval", "4", recipe_name="finetune_bert", nproc=nproc,
                          loss_name="classification loss")
    assert re.search(r"epoch \d+ \| accuracy: [0-9.]+ \| f1: [0-9.]+", log), log[-3000:]


def test_two_nodes_meet_through_the_seed_environment(assets, tmp_path):
    """Two 'nodes' on this host, one process each, TP=2 across them: NNODES, NODE_RANK, MASTER_ADDR and
    MASTER_PORT reach torchrun, and both write under one output directory (a shared file system)."""
    from megatron_patch.distributed import free_port

    out = tmp_path / "out"
    flags = ["--cpu", "--nproc-per-node", "1", "--tp", "2", "--seq-length", "32", "--data-path", assets.gpt_prefix,
             "--vocab-file", assets.gpt_options["vocab_file"], "--merge-file", assets.gpt_options["merge_file"],
             "--micro-batch-size", "4", "--train-iters", "6", "--lr", "3e-3", "--output-dir", str(out),
             "--", "--log-interval", "1", "--split", "98,2,0"]
    launch = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    nodes = [subprocess.Popen(["bash", GPT, *flags], cwd=tmp_path, env=_environment(NODE_RANK=str(rank), **launch),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    for rank in (0, 1):
        log = (out / "logs" / f"pretrain_gpt_node{rank}.log").read_text()
        assert f"--nnodes=2 --node-rank={rank} --master-addr=127.0.0.1 --master-port={launch['MASTER_PORT']}" in log
    losses = _losses((out / "logs" / "pretrain_gpt_node1.log").read_text())  # the last rank logs
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert json.loads((out / "checkpoints" / "megatron_patch_args.json").read_text())["tensor_model_parallel_size"] == 2
