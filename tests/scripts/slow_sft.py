"""examples/gpt/finetune_gpt.py whose forward steps wait 0.2 s from iteration SLOW_FROM on, computing the same, so
that a test has time to kill it between iterations.

    SLOW_FROM=9 rapidformer --user-script tests/scripts/slow_sft.py <finetune_gpt.py's flags>
"""

import importlib.util
import os
import time

from megatron_patch.training.engine import RapidformerEngine

_spec = importlib.util.spec_from_file_location(
    "finetune_gpt", os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt", "finetune_gpt.py"))
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
SLOW_FROM = int(os.environ["SLOW_FROM"])


class SlowFinetuner(_module.SFTFinetuner):
    def run_forward_step(self, batch, model):
        # self.iteration counts finished steps: the one running now is self.iteration + 1.
        if self.iteration + 1 >= SLOW_FROM:
            time.sleep(0.2)
        return super().run_forward_step(batch, model)


SlowFinetuner(engine=RapidformerEngine()).train()
