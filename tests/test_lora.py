"""LoRA fine-tuning (model/lora.py): the same losses and adapters at every layout as in one process, the base
frozen and out of the optimizer.

    python -m pytest -q -p no:cacheprovider tests/test_lora.py

The oracle is the single-process run of a tiny LLaMA (grouped queries, SwiGLU: both fused layers): its base
weights are filled by checkpoint key (``tests.model_oracles.init_weights``, the same at every layout), adapters
are added to every attention and MLP linear, and each layout trains on the same global batches.
"""

import pytest

from megatron_patch.testing import run_on_ranks
from tests.model_oracles import GLOBAL_BATCH, SEQ, VOCAB

STEPS = 3
RANK, ALPHA = 4, 8.0


def _lora_keys_gathered(chunks) -> dict | None:
    """The global adapter tensors by checkpoint key (numpy) on rank 0, None elsewhere."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from tests.model_oracles import _local_slice, _sharded_tensors, gather_shards

    shards = []
    for chunk in chunks:
        for sharded in _sharded_tensors(chunk.sharded_state_dict()):
            if "lora_" in sharded.key and is_main_replica(sharded.replica_id):
                index, local_shape = _local_slice(sharded)
                shards.append((sharded.key, tuple(sharded.global_shape), index,
                               sharded.data.detach().float().clone().reshape(local_shape)))
    return gather_shards(shards)


def train_lora(rank, world_size, tp, pp, sequence_parallel=False, recompute=False, distributed_optimizer=False,
               model="tiny-llama", precision="fp32"):
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
    from megatron_patch.model.lora import LoraSettings, apply_lora
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model
    from tests.model_oracles import init_weights, model_config
    from tests.test_parallel_training import _gpt_batches

    layout = initialize_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=7)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              sequence_parallel=sequence_parallel, precision=precision,
                              **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                                 if recompute else {}))
    chunks = build_model_chunks(model_config(model, num_layers=2), parallel, padded_vocab_size(VOCAB, 1, tp))
    init_weights(chunks)
    apply_lora(chunks, LoraSettings(rank=RANK, alpha=ALPHA), seed=11)
    base = {n: p.detach().clone() for n, p in chunks[0].named_parameters() if not p.requires_grad}
    ddp = wrap_model(chunks, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer))
    optimizer = build_optimizer(ddp, OptimizerConfig(optimizer="adam", lr=1e-2, bf16=precision == "bf16",
                                                     use_distributed_optimizer=distributed_optimizer))
    held = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    trainable = sum(p.numel() for p in chunks[0].parameters() if p.requires_grad)
    dp_rank, dp = parallel_state.get_data_parallel_rank(), layout.data_parallel_size
    losses = []
    for step in range(STEPS):
        stats = train_step(lm_forward_step, _gpt_batches(step, dp_rank, dp, 1), ddp, optimizer,
                           num_microbatches=GLOBAL_BATCH // dp, seq_length=SEQ, micro_batch_size=1)
        losses.append(stats.loss)
    unchanged = all(torch.equal(p, base[n]) for n, p in chunks[0].named_parameters() if n in base)
    return dict(losses=losses, adapters=_lora_keys_gathered(chunks), base_unchanged=unchanged,
                optimizer_numel=held, trainable_numel=trainable)


@pytest.fixture(scope="module")
def reference():
    [result] = run_on_ranks(train_lora, 1, args=(1, 1))
    assert result["losses"][-1] < result["losses"][0], "the reference run must learn"
    assert result["base_unchanged"]
    # Only the adapters are held: the optimizer's fp32 parameters are the trainable ones, no base weight.
    assert result["optimizer_numel"] == result["trainable_numel"] > 0
    return result


def _last_stage(results):
    return [r for r in results if r["losses"][0] is not None][0]


@pytest.mark.parametrize("world_size,tp,pp,options", [
    (2, 2, 1, {}), (2, 1, 2, {}), (4, 2, 2, {}),
    (2, 2, 1, {"sequence_parallel": True, "recompute": True}),
    (2, 1, 1, {"distributed_optimizer": True}),
], ids=["tp2", "pp2", "tp2xpp2", "tp2-sp-recompute", "dp2-distopt"])
def test_lora_layout_matches_single_process(reference, world_size, tp, pp, options):
    import numpy as np

    results = run_on_ranks(train_lora, world_size, args=(tp, pp), kwargs=options)
    assert _last_stage(results)["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert all(r["base_unchanged"] for r in results)
    adapters = results[0]["adapters"]
    assert sorted(adapters) == sorted(reference["adapters"])
    for key, expected in reference["adapters"].items():
        # Adam divides each step by the gradient's running RMS: an element whose gradient is near zero moves by
        # up to lr whatever its last bits, so the weights are compared to 1% of lr (losses agree to 1e-5).
        np.testing.assert_allclose(adapters[key], expected, rtol=1e-4, atol=1e-4, err_msg=key)
    # The adapters moved off their initialisation (B starts at zero).
    assert any(np.abs(v).max() > 0 for k, v in adapters.items() if k.endswith("lora_B"))
    # The dry-run plan counts what the model holds: every adapter, and those of the most loaded GPU.
    plan = _plan(world_size, tp, pp)
    assert plan.lora_parameters == reference["trainable_numel"]
    assert plan.lora_parameters_per_gpu == max(r["trainable_numel"] for r in results)


def _plan(world_size, tp, pp):
    from megatron_patch.training.plan import build_plan

    return build_plan(["--model-name", "tiny-llama", "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size",
                       "64", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--nproc-per-node",
                       str(world_size), "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                       str(pp), "--load", "base-not-needed-by-a-plan", "--finetune", "--lora-rank", str(RANK),
                       "--lora-alpha", str(ALPHA)])


def test_the_plan_shows_trainable_parameters_and_the_memory_lora_saves():
    text = _plan(2, 2, 1).render()
    assert "LoRA: rank 4, alpha 8 on linear_qkv,linear_proj,linear_fc1,linear_fc2" in text
    assert "LoRA saves" in text and "against full fine-tuning" in text


# -- the trainer: a base trained here, LoRA fine-tuning on it, checkpoints and resume ------------------------------

def train_gpt(rank, world_size, argv):
    """The Pretrainer's run of ``argv``: its losses, Adam's state on this rank (elements) and its checkpoint."""
    from megatron_patch.errors import UserError
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    try:
        trainer = MegatronGPTPretrainer(engine=Engine(argv))
        log = trainer.train()
    except UserError as error:
        return {"error": str(error)}
    inner = trainer.optimizer.optimizer
    state = sum(t.numel() for s in inner.state.values() for t in s.values() if hasattr(t, "numel") and t.dim())
    return {"losses": [loss for _, loss in log.train_losses], "optimizer_state": state}


def _size(directory: str, suffix: str = "") -> int:
    import os

    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(directory) for name in names
               if name.endswith(suffix))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from seed_scripts.assets import rapidformer_assets

    return rapidformer_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def base(assets, tmp_path_factory):
    """A tiny GPT trained for 2 iterations: the base every LoRA run here adapts."""
    from test_trainer_megatron import _gpt_flags

    root = str(tmp_path_factory.mktemp("base") / "ckpt")
    [result] = run_on_ranks(train_gpt, 1, args=(_gpt_flags(assets, *_BATCH, "--train-iters", "2", "--save", root),))
    assert "error" not in result, result
    return root


_BATCH = ("--micro-batch-size", "2", "--global-batch-size", "4")


def _lora_flags(assets, *extra):
    from test_trainer_megatron import _gpt_flags

    return _gpt_flags(assets, *_BATCH, "--lora-rank", "4", "--lora-alpha", "8", *extra)


def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly(assets, base, tmp_path):
    from megatron_patch.checkpoint.format import checkpoint_dir, write_tracker

    lora, full = str(tmp_path / "lora"), str(tmp_path / "full")
    [unbroken] = run_on_ranks(train_gpt, 1, args=(_lora_flags(
        assets, "--load", base, "--finetune", "--train-iters", "4", "--save", lora, "--save-interval", "2"),))
    [full_ft] = run_on_ranks(train_gpt, 1, args=(_gpt_flags_full(assets, base, full),))
    losses = unbroken["losses"]
    # B starts at zero: the first step's loss is the base's, as full fine-tuning from the same base sees it.
    assert len(losses) == 4 and losses[0] == full_ft["losses"][0] and losses[1] != full_ft["losses"][1], losses
    # What a kill after iteration 2's save leaves: that checkpoint as the latest. Resuming it (base, then the
    # adapters with their optimizer and scheduler) continues bitwise.
    write_tracker(lora, 2)
    [resumed] = run_on_ranks(train_gpt, 1, args=(_lora_flags(assets, "--load", lora, "--train-iters", "4"),))
    assert resumed["losses"] == losses[2:]
    # Adam's state and the checkpoint scale with the adapters, not the base.
    assert unbroken["optimizer_state"] < full_ft["optimizer_state"] / 10
    assert _size(checkpoint_dir(lora, 2)) < _size(checkpoint_dir(full, 2)) / 3
    print(f"\nAdam state elements: LoRA {unbroken['optimizer_state']}, full {full_ft['optimizer_state']}; checkpoint "
          f"bytes: LoRA {_size(checkpoint_dir(lora, 2))}, full {_size(checkpoint_dir(full, 2))} (tensor files: "
          f"LoRA {_size(checkpoint_dir(lora, 2), '.distcp')}, full {_size(checkpoint_dir(full, 2), '.distcp')})")


def _gpt_flags_full(assets, base, save):
    from test_trainer_megatron import _gpt_flags

    return _gpt_flags(assets, *_BATCH, "--load", base, "--finetune", "--train-iters", "2", "--save", save)


def test_lora_refusals_are_one_line(assets, base, tmp_path):
    import shutil

    from test_trainer_megatron import _gpt_flags

    lora = str(tmp_path / "lora")
    [trained] = run_on_ranks(train_gpt, 1, args=(_lora_flags(
        assets, "--load", base, "--finetune", "--train-iters", "1", "--save", lora),))
    assert "error" not in trained, trained
    resume = ("--load", lora, "--train-iters", "2")
    [wrong_rank] = run_on_ranks(train_gpt, 1, args=(_lora_flags(assets, *resume, "--lora-rank", "8"),))
    assert "--lora-rank 4" in wrong_rank["error"] and "\n" not in wrong_rank["error"]
    [no_finetune] = run_on_ranks(train_gpt, 1, args=(_lora_flags(assets, "--load", base, "--train-iters", "1"),))
    assert "add --finetune" in no_finetune["error"]
    moved = str(tmp_path / "moved")
    shutil.move(base, moved)
    try:
        [missing] = run_on_ranks(train_gpt, 1, args=(_lora_flags(assets, *resume),))
        # Another base under the same name: trained from another seed.
        run_on_ranks(train_gpt, 1, args=(_gpt_flags(assets, *_BATCH, "--train-iters", "2", "--save", base,
                                                     "--seed", "9"),))
        [other] = run_on_ranks(train_gpt, 1, args=(_lora_flags(assets, *resume),))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.move(moved, base)
    assert "is missing" in missing["error"] and "\n" not in missing["error"], missing
    assert "not the one the adapters were trained on" in other["error"] and "\n" not in other["error"], other


# -- out to Hugging Face: PEFT's adapters and the merged model against our model --------------------------------

def train_lora_on_converted(rank, world_size, argv, sequences, tokens):
    """LoRA training of a converted checkpoint (tests.convert_oracles' fixed-data Pretrainer); the trained model's
    logits on ``tokens`` (last stage, the vocabulary's rows only)."""
    import torch

    from megatron_patch.convert.verify import megatron_outputs
    from megatron_patch.training.engine import Engine
    from tests.convert_oracles import _fixed_data_pretrainer

    trainer = _fixed_data_pretrainer(sequences)(engine=Engine(argv))
    log = trainer.train()
    info = trainer.checkpoint_info
    inputs = {"tokens": torch.tensor([tokens]), "position_ids": torch.arange(len(tokens))[None]}
    out = megatron_outputs(trainer.model, info, inputs, {"logits"})
    return {"losses": [loss for _, loss in log.train_losses],
            "logits": None if out is None else out["logits"][0, :, :info.model_config.vocab_size].numpy()}


def hf_logits(rank, world_size, hf_dir, adapter_dir, merged_dir, tokens):
    """Logits on ``tokens`` of the Hugging Face base, of PEFT's model (the base with the exported adapters) and of
    the merged export, through transformers and peft."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tokens])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=ids).logits[0]
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), adapter_dir).eval()
        adapted = peft_model(input_ids=ids).logits[0]
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(input_ids=ids).logits[0]
    return {"base": base.numpy(), "peft": adapted.numpy(), "merged": merged.numpy()}


def test_exported_peft_adapter_and_merged_model_give_our_logits(tmp_path):
    import os

    import numpy as np
    from transformers import GenerationConfig

    from tests.convert_oracles import cli, make_hf_model, training_sequences

    hf, converted = make_hf_model("llama-gqa", str(tmp_path / "hf")), str(tmp_path / "converted")
    GenerationConfig(eos_token_id=3, max_new_tokens=7).save_pretrained(hf)  # kept as a tokenizer file
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", converted,
                                       "--no-progress"],)) == [0]
    lora, adapter, merged = (str(tmp_path / name) for name in ("lora", "adapter", "merged"))
    sequences = training_sequences()
    tokens = sequences[0][:12]
    # At TP=2 with the q/k/v and gate/up parts named as PEFT names them: the export gathers the shards.
    argv = ["--load", converted, "--finetune", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--seq-length", "16", "--train-iters", "3", "--lr", "1e-2",
            "--lr-decay-style", "constant", "--seed", "3", "--save", lora, "--lora-rank", "4", "--lora-alpha", "8",
            "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
    ranks = run_on_ranks(train_lora_on_converted, 2, args=(argv, sequences, tokens), timeout=300)
    ours = ranks[0]["logits"]
    for out, extra in ((adapter, []), (merged, ["--merge-lora"])):
        assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", lora, "--save-dir", out,
                                           "--no-progress", *extra],)) == [0]
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    # The merged model ships as the base did: with the files the base's conversion kept beside its tokenizer.
    assert GenerationConfig.from_pretrained(merged).max_new_tokens == 7
    [reference] = run_on_ranks(hf_logits, 1, args=(hf, adapter, merged, tokens))
    np.testing.assert_allclose(reference["peft"], ours, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(reference["merged"], ours, rtol=1e-4, atol=1e-4)
    # The adapters moved the model off its base, by far more than the tolerance above.
    assert np.abs(reference["peft"] - reference["base"]).max() > 1e-2


# -- in from PEFT: an adapter peft made on the Hugging Face base trains on here --------------------------------

def make_peft_adapter(rank, world_size, hf_dir, out_dir, target_modules):
    """A PEFT LoRA adapter (r 4, alpha 8) on ``hf_dir``'s model, its B random (PEFT starts it at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    model.save_pretrained(out_dir)


def peft_loss(rank, world_size, hf_dir, adapter_dir, sequences, padded_vocab):
    """transformers + peft's loss on ``sequences`` (what the trainer's first step must report)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = torch.tensor(sequences)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir), adapter_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    logits = torch.nn.functional.pad(logits, (0, padded_vocab - logits.shape[-1]))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


_ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# Gemma 3's o_proj and down_proj are followed by sandwich norms: PEFT's adapters add before them.
@pytest.mark.parametrize("model,targets", [("llama-gqa", ["q_proj", "v_proj", "down_proj"]),
                                           ("llama-gqa", _ALL_LINEARS), ("gemma3", _ALL_LINEARS)],
                         ids=["llama-default-q-v", "all-linears", "gemma3-all-linears"])
def test_a_peft_adapter_converts_and_trains_on_from_peft_s_loss(tmp_path, model, targets):
    from megatron_patch.checkpoint.format import read_info
    from tests.convert_oracles import cli, make_hf_model, train_converted, training_sequences

    hf, converted = make_hf_model(model, str(tmp_path / "hf")), str(tmp_path / "converted")
    peft_dir, lora = str(tmp_path / "peft"), str(tmp_path / "lora")
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", converted,
                                       "--no-progress"],)) == [0]
    run_on_ranks(make_peft_adapter, 1, args=(hf, peft_dir, targets))
    assert run_on_ranks(cli, 1, args=(["peft-to-megatron", "--peft-dir", peft_dir, "--base-dir", converted,
                                       "--save-dir", lora],)) == [0]
    record = _lora_args(lora)
    sequences = training_sequences()
    # PEFT's separate q and v adapters (each rank 4) become one linear_qkv adapter of rank 8 (alpha 16: the same
    # scaling); linear_fc2's is padded to it.
    rank = 8 if targets[0] == "q_proj" and "gate_proj" not in targets else 12
    assert (record.lora_rank, record.lora_alpha) == (rank, 2.0 * rank)
    argv = ["--load", lora, "--finetune", "--micro-batch-size", "4", "--global-batch-size", "4", "--seq-length",
            "16", "--train-iters", "2", "--lr", "1e-2", "--lr-decay-style", "constant", "--seed", "3",
            "--lora-rank", str(rank), "--lora-alpha", str(2.0 * rank), "--lora-target-modules",
            record.lora_target_modules]
    [trained] = run_on_ranks(train_converted, 1, args=(argv, sequences, sequences[0][:4], 1), timeout=300)
    [expected] = run_on_ranks(peft_loss, 1, args=(hf, peft_dir, sequences, read_info(converted).padded_vocab_size))
    losses = trained["losses"]
    assert abs(losses[0] - expected) < 1e-4 * expected, (losses, expected)
    assert losses[1] < losses[0]


def _lora_args(root):
    from megatron_patch import compat
    from megatron_patch.checkpoint.format import read_args_state, weights_dir

    return read_args_state(compat.common_state_source(weights_dir(root)))["args"]


# -- what the model has: a mixture of experts' attention; named modules it lacks are refused -------------------

def lora_on(rank, world_size, name, named):
    """Adapt a ``name`` model (registry) with ``named`` target modules (() for the default); the adapted layers,
    or the refusal's text."""
    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.errors import UserError
    from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
    from megatron_patch.model.lora import LoraSettings, apply_lora, resolve_targets
    from megatron_patch.model.parallel import ParallelConfig
    from tests.model_oracles import model_config

    initialize_distributed(seed=1)
    config = model_config(name, num_layers=2)
    chunks = build_model_chunks(config, ParallelConfig(), padded_vocab_size(VOCAB, 1, 1))
    settings = LoraSettings(rank=2, alpha=4.0, **(dict(targets=resolve_targets(named), named=named) if named else {}))
    try:
        apply_lora(chunks, settings, seed=1)
    except UserError as error:
        return str(error)
    return sorted({n.rsplit(".", 2)[-2] for n, p in chunks[0].named_parameters() if p.requires_grad})


def test_a_mixture_of_experts_adapts_its_attention_and_a_missing_module_is_one_line():
    moe, gate_on_gelu, fc1_on_moe = run_on_ranks(lora_on, 1, args=("tiny-mixtral", ()))[0], \
        run_on_ranks(lora_on, 1, args=("tiny-gpt2", ("gate_proj", "up_proj")))[0], \
        run_on_ranks(lora_on, 1, args=("tiny-mixtral", ("linear_qkv", "linear_fc1")))[0]
    # Only adapters train; the experts (and router) are not adapted.
    assert moe == ["linear_proj", "linear_qkv"], moe
    assert "has no gate_proj" in gate_on_gelu and "\n" not in gate_on_gelu
    assert "has no linear_fc1 layer outside its experts" in fc1_on_moe and "\n" not in fc1_on_moe


def test_lora_on_a_mixture_of_experts_at_tp2_matches_single_process():
    import numpy as np

    [reference] = run_on_ranks(train_lora, 1, args=(1, 1), kwargs={"model": "tiny-mixtral"})
    # megatron-core trains experts under TP only with sequence parallelism.
    results = run_on_ranks(train_lora, 2, args=(2, 1), kwargs={"model": "tiny-mixtral", "sequence_parallel": True})
    assert reference["base_unchanged"] and all(r["base_unchanged"] for r in results)
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for key, expected in reference["adapters"].items():
        np.testing.assert_allclose(results[0]["adapters"][key], expected, rtol=1e-4, atol=1e-4, err_msg=key)


def test_sigkill_mid_run_then_resume_gives_the_unbroken_run_bitwise(assets, base, tmp_path):
    """A LoRA job killed after its iteration-5 step resumes from its iteration-4 save (``--load`` that save, no
    ``--finetune``) with every iteration's record (loss, grad norm, lr) equal to the unbroken run's; dropout on
    the adapters and a warm-up + cosine schedule make the RNG and scheduler state count."""
    import re

    from test_reliability import (
        FAULTY_SCRIPT, ITERS, _assert_same_as, _flags, _kill_when, _last_iteration, _records, _run, _start,
    )

    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--save-interval", "2"]
    reference_logs, logs, save = str(tmp_path / "reference"), str(tmp_path / "logs"), str(tmp_path / "lora")
    status, output = _run(_flags(assets, "--load", base, "--finetune", *lora, "--save", str(tmp_path / "unbroken"),
                                 "--log-dir", reference_logs))
    assert status == 0, output
    # Iterations 6 on wait 0.2 s per microbatch (tests/scripts/faulty_gpt.py's "slow", which changes no number),
    # so the kill lands mid-run even when this process is slow to see iteration 5 on a loaded machine.
    process = _start(_flags(assets, "--load", base, "--finetune", *lora, "--save", save, "--log-dir", logs),
                     script=FAULTY_SCRIPT, env={"FAULT": "slow", "FAULT_RANK": "0",
                                                "FAULT_ITERATIONS": ",".join(map(str, range(6, ITERS + 1)))})
    assert _kill_when(process, lambda: _last_iteration(logs) >= 5), "the job ended before the kill"
    assert _last_iteration(logs) < ITERS
    status, output = _run(_flags(assets, "--load", save, *lora, "--save", save, "--log-dir", logs))
    assert status == 0, output
    assert re.search(rf"successfully loaded checkpoint from {re.escape(save)} at iteration [1-9]", output), output
    _assert_same_as(_records(reference_logs), _records(logs))


def test_lora_in_bf16_at_tp2xdp2_with_the_distributed_optimizer_follows_one_process():
    """bf16 weights and adapters with fp32 main copies of the adapters alone: TP2 x DP2 with the distributed optimizer
    against one bf16 process (bf16's rounding differs with the summation order: a loose tolerance)."""
    [reference] = run_on_ranks(train_lora, 1, args=(1, 1), kwargs={"precision": "bf16"})
    results = run_on_ranks(train_lora, 4, args=(2, 1), kwargs={"precision": "bf16", "distributed_optimizer": True})
    assert reference["base_unchanged"] and all(r["base_unchanged"] for r in results)
    assert reference["optimizer_numel"] == reference["trainable_numel"]
    assert results[0]["losses"] == pytest.approx(reference["losses"], rel=2e-2)
    assert reference["losses"][-1] < reference["losses"][0]
