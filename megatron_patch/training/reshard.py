"""``megatron-patch checkpoint reshard``: rewrite a checkpoint whose distributed-optimizer state loads only at the
tensor/pipeline layout it was saved at (Megatron-LM's default format, ``dp_reshardable``, which ours is too) so that
it resumes at another one.

Example::

    megatron-patch checkpoint reshard --load-dir ckpt --save-dir ckpt-any       # fully reshardable: any layout
    megatron-patch checkpoint reshard --load-dir ckpt --save-dir ckpt-tp1 --target-tensor-parallel-size 1

Without a target the latest checkpoint is written again at its own layout with the optimizer state gathered per
parameter (``fully_reshardable``, as ``--dist-ckpt-optim-fully-reshardable`` saves it), which loads at any layout.
With a target it is then loaded at that layout and written there in the default format, which loads there as fast
as a save made there. Processes on this host's CPUs do it (gloo), one per rank of the larger layout. Each write is
the trainer's checksummed save, published by rename with the tracker last, so an interrupted reshard leaves no
checkpoint behind. The weights, the optimizer state, the scheduler, the data position and every rank's RNG files
are the loaded checkpoint's: a resume from the result trains as a resume from a fully reshardable save of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
import shutil
import sys

from megatron_patch.checkpoint.format import (
    RELEASE, TRACKER_FILE, checkpoint_dir, checkpoint_format, find_info, read_args_state, read_tracker,
)
from megatron_patch.checkpoint.integrity import verify_checkpoint
from megatron_patch.errors import FlagParser, UserError, one_line_errors, unwind_on_sigterm
from megatron_patch.staging import killed_leftovers, staging_tag, tag_pattern

PROG = "megatron-patch checkpoint"
# Megatron-LM's args that hold the layout: a resharded checkpoint records its own.
_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "num_layers_per_virtual_pipeline_stage", "data_parallel_size", "megatron_patch")


def _parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog=PROG, description=__doc__.splitlines()[0].strip("`: "))
    commands = parser.add_subparsers(dest="command", required=True)
    reshard = commands.add_parser(
        "reshard", help="rewrite the latest checkpoint's distributed-optimizer state to load at another TP/PP")
    reshard.add_argument("--load-dir", required=True, help="the checkpoint directory (its tracker names the iteration)")
    reshard.add_argument("--save-dir", required=True, help="a new directory for the resharded checkpoint")
    reshard.add_argument("--target-tensor-parallel-size", type=int,
                         help="write the optimizer state for this TP (default: fully reshardable, for any)")
    reshard.add_argument("--target-pipeline-parallel-size", type=int,
                         help="write the optimizer state for this PP (default: fully reshardable, for any)")
    # Given by the command to the ranks it starts: the fully reshardable checkpoint on the way to the target layout.
    reshard.add_argument("--staging", help=argparse.SUPPRESS)
    return parser


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a reshard reads from the checkpoint before any process starts."""

    root: str
    save_dir: str
    iteration: int
    info: object
    args: argparse.Namespace
    saved: object
    target: tuple[int, int] | None
    fully_reshardable: bool
    world: int


def _plan(args: argparse.Namespace) -> _Plan:
    """``args`` checked against the checkpoint, each wrong input refused in one line before any process starts."""
    from megatron_patch import compat
    from megatron_patch.checkpoint.megatron import recorded_sharding, saved_layout, saved_metadata
    from megatron_patch.model.parallel import ParallelConfig

    root = args.load_dir
    iteration = read_tracker(root)
    if iteration is None:
        raise UserError(f"--load-dir {root}: no {TRACKER_FILE}; give the directory a training run saved to")
    if iteration == RELEASE:
        raise UserError(f"--load-dir {root} holds a converted checkpoint (weights only, no optimizer state), which "
                        "loads at any layout as it is: nothing to reshard")
    path = checkpoint_dir(root, iteration)
    if checkpoint_format(path) != "torch_dist":
        raise UserError(f"--load-dir {root}: {path} is not a torch_dist checkpoint (Megatron-LM's per-rank files "
                        "load at their own layout only); resume it with --no-load-optim to load its model alone")
    if os.path.abspath(args.save_dir) == os.path.abspath(root):
        raise UserError(f"--save-dir {args.save_dir} is --load-dir; give a new directory")
    if read_tracker(args.save_dir) is not None:
        raise UserError(f"--save-dir {args.save_dir} holds a checkpoint already; give a new directory")
    # Every file there at its length before anything is read from it (the ranks' load compares the checksums).
    verify_checkpoint(path, megatron=True, checksums=False)
    common = read_args_state(compat.common_state_source(path))
    found = find_info(root)
    if found is None or common.get("args") is None:
        raise UserError(f"--load-dir {root}: {path} records no model (no megatron_patch_args.json, no args in its "
                        "common state), so it cannot be rebuilt to reshard")
    if getattr(common["args"], "lora_base", None) is not None:
        # Its model is the base's weights and the adapters on them (checkpoint/lora.py), not rebuilt here.
        raise UserError(f"--load-dir {root} holds LoRA adapters on {common['args'].lora_base}, which this command "
                        "does not rebuild; resume them at their saved TP/PP, or with --no-load-optim at another")
    sharding = saved_metadata(common).get("distrib_optim_sharding_type")
    if not getattr(common["args"], "use_distributed_optimizer", True) or recorded_sharding(
            common.get("optimizer")) is None:
        raise UserError(f"--load-dir {root}: {path} holds no distributed-optimizer state (saved without "
                        "--use-distributed-optimizer, or without its optimizer); it loads at any layout as it is: "
                        "nothing to reshard")
    saved = saved_layout(common["args"])
    relaid = args.target_tensor_parallel_size is not None or args.target_pipeline_parallel_size is not None
    fully = sharding == "fully_reshardable"
    if fully and not relaid:
        raise UserError(f"--load-dir {root}: {path}'s optimizer state is fully reshardable already and loads at any "
                        "layout; give --target-tensor-parallel-size/--target-pipeline-parallel-size to write it for "
                        "one layout")
    info = found[0]
    world = saved.tensor * saved.pipeline * saved.expert
    target = None
    if relaid:
        target = (args.target_tensor_parallel_size or saved.tensor,
                  args.target_pipeline_parallel_size or saved.pipeline)
        layout = ParallelConfig(tensor_model_parallel_size=target[0], pipeline_model_parallel_size=target[1],
                                expert_model_parallel_size=saved.expert)
        try:
            layout.check_layout(info.model_config, padded_vocab_size=info.padded_vocab_size)
        except ValueError as error:
            raise UserError(f"{error} (--target-tensor-parallel-size/--target-pipeline-parallel-size)") from None
        world = math.lcm(world, target[0] * target[1] * saved.expert)
    return _Plan(root=root, save_dir=args.save_dir, iteration=iteration, info=info, args=common["args"], saved=saved,
                 target=target, fully_reshardable=fully, world=world)


def reshard(args: argparse.Namespace) -> int:
    """Check ``args``, then run the reshard on ``_plan``'s world of processes, on this host; with a target layout
    from a checkpoint that is not fully reshardable, through a fully reshardable one in a directory beside
    ``--save-dir``, removed after (also when the command is stopped)."""
    plan = _plan(args)
    if args.staging is not None:  # a rank of the world started below
        _reshard_here(plan, args.staging or None)
        return 0
    from megatron_patch.cli import launch

    _remove_killed_staging(args.save_dir)
    staging = ""
    if plan.target is not None and not plan.fully_reshardable:
        # Named by this process, so that the next reshard into --save-dir removes it if this one is killed.
        staging = os.path.abspath(args.save_dir) + staging_tag("reshard")
        os.makedirs(staging)
    try:
        status = launch("megatron_patch.training.reshard", plan.world, [
            "reshard", "--load-dir", args.load_dir, "--save-dir", args.save_dir, "--staging", staging,
            *(["--target-tensor-parallel-size", str(plan.target[0]),
               "--target-pipeline-parallel-size", str(plan.target[1])] if plan.target else [])])
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    if status == 0:
        saved = f"TP={plan.saved.tensor} PP={plan.saved.pipeline}"
        written = (f"TP={plan.target[0]} PP={plan.target[1]}, loadable at that layout and any data-parallel size"
                   if plan.target else f"{saved}, fully reshardable: loadable at any layout")
        print(f"{PROG}: {plan.root} (iteration {plan.iteration}, {saved}) written to {args.save_dir} at {written}; "
              f"resume with --load {args.save_dir}", flush=True)
    return status


def _remove_killed_staging(save_dir: str) -> None:
    """Remove the staging directories that reshards into ``save_dir`` left beside it when they were killed on this
    host (a SIGKILL runs no cleanup, and each holds a whole checkpoint with its optimizer state)."""
    parent, base = os.path.split(os.path.abspath(save_dir))
    for path, pid, _ in killed_leftovers(parent, re.escape(base) + tag_pattern("reshard")):
        shutil.rmtree(path, ignore_errors=True)
        print(f"note: removed {path}, left by process {pid}, a reshard that was killed", file=sys.stderr, flush=True)


def _reshard_here(plan: _Plan, staging: str | None) -> None:
    """On every rank: load at the saved layout and write fully reshardable (to ``staging`` when a target layout
    follows); with a target, load that at the target layout and write it there."""
    from megatron_patch import compat

    saved = plan.saved
    if plan.target is None:
        _load_and_save(plan, plan.root, plan.save_dir, saved.tensor, saved.pipeline, saved.virtual, True)
    else:
        if staging is not None:
            _load_and_save(plan, plan.root, staging, saved.tensor, saved.pipeline, saved.virtual, True)
        _load_and_save(plan, staging or plan.root, plan.save_dir, plan.target[0], plan.target[1], 1, False)
    compat.destroy_model_parallel_and_free_groups()


class _CarriedState:
    """The learning-rate scheduler's state, carried from the loaded checkpoint to the written one as it is."""

    def __init__(self):
        self.state = {}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _load_and_save(plan: _Plan, source: str, destination: str, tensor: int, pipeline: int, virtual: int,
                   fully_reshardable: bool) -> None:
    """Build the checkpoint's model and distributed optimizer at this layout (its buckets as the saving run laid
    them out: ``args``' gradient-reduction settings), load ``source``'s latest checkpoint into them and save it to
    ``destination``."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.checkpoint.megatron import load_megatron_checkpoint, save_megatron_checkpoint
    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.training.step import build_optimizer, wrap_model

    args, info = plan.args, plan.info
    initialize_distributed(tensor, pipeline, virtual if virtual > 1 else None,
                           expert_model_parallel_size=plan.saved.expert)
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    parallel = ParallelConfig(tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline,
                              virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
                              expert_model_parallel_size=plan.saved.expert, precision=precision)
    chunks = wrap_model(build_model_chunks(info.model_config, parallel, info.padded_vocab_size, initialize=False),
                        DistributedDataParallelConfig(
                            use_distributed_optimizer=True, overlap_grad_reduce=getattr(args, "overlap_grad_reduce",
                                                                                        False),
                            grad_reduce_in_fp32=getattr(args, "accumulate_allreduce_grads_in_fp32",
                                                        precision != "fp32"),
                            bucket_size=getattr(args, "ddp_bucket_size", None)))
    optimizer = build_optimizer(chunks, OptimizerConfig(
        optimizer="adam", lr=getattr(args, "lr", None) or 1e-4, fp16=precision == "fp16", bf16=precision == "bf16",
        params_dtype=parallel.params_dtype, use_distributed_optimizer=True,
        decoupled_lr=getattr(args, "decoupled_lr", None), decoupled_min_lr=getattr(args, "decoupled_min_lr", None)))
    scheduler = _CarriedState()
    logger = logging.getLogger("rapidformer")
    load_megatron_checkpoint(source, chunks, optimizer, scheduler, logger=logger)
    data_parallel = torch.distributed.get_world_size() // (tensor * pipeline)
    run_args = {**{k: v for k, v in vars(args).items() if k not in _LAYOUT_ARGS}, "data_parallel_size": data_parallel,
                "virtual_pipeline_model_parallel_size": virtual if virtual > 1 else None}
    at_layout = dataclasses.replace(info, format="torch_dist", tensor_model_parallel_size=tensor,
                                    pipeline_model_parallel_size=pipeline)
    save_megatron_checkpoint(destination, plan.iteration, chunks, optimizer, scheduler, at_layout, run_args=run_args,
                             fully_reshardable=fully_reshardable, rng_from=checkpoint_dir(source, plan.iteration))


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    unwind_on_sigterm()  # a SIGTERM removes the staging directory, as it does a conversion's
    return reshard(args)


if __name__ == "__main__":
    from megatron_patch.cli import run

    run(main)
