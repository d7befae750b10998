"""The megatron GPT pretraining task with a fault injected on one rank, chosen by environment variables.

    FAULT=raise|hang|nan|slow FAULT_RANK=1 FAULT_ITERATIONS=3,4 \
        rapidformer --user-script tests/scripts/faulty_gpt.py <the --task pretraining flags>

``raise``: the rank raises in its forward step; ``hang``: it sleeps instead of computing (its peers wait in a
collective); ``nan``: its loss is NaN, so every gradient is (a poisoned step); ``slow``: it waits 0.2 s before
computing, and computes the same (a test then has time to act between iterations).
"""

import os
import time

import torch

from megatron_patch.training.engine import RapidformerEngine
from megatron_patch.training.tasks import MegatronGPTPretrainer

FAULT = os.environ["FAULT"]
RANKS = {int(r) for r in os.environ.get("FAULT_RANK", "0").split(",")}
ITERATIONS = {int(i) for i in os.environ["FAULT_ITERATIONS"].split(",")}


class FaultyPretrainer(MegatronGPTPretrainer):
    def run_forward_step(self, data_iterator, model):
        # self.iteration counts finished steps: the one running now is self.iteration + 1.
        faulty = torch.distributed.get_rank() in RANKS and self.iteration + 1 in ITERATIONS
        if faulty and FAULT == "raise":
            raise RuntimeError(f"injected fault on rank {torch.distributed.get_rank()}")
        if faulty and FAULT in ("hang", "slow"):
            time.sleep(3600 if FAULT == "hang" else 0.2)
        output, loss_func = super().run_forward_step(data_iterator, model)
        return (output * float("nan") if faulty and FAULT == "nan" else output), loss_func


FaultyPretrainer(engine=RapidformerEngine()).train()
