"""An example's Finetuner (examples/gpt/finetune_gpt.py, or SLOW_EXAMPLE's) whose forward steps wait 0.2 s from
iteration SLOW_FROM on, computing the same, so that a test has time to kill it between iterations.

    SLOW_FROM=9 SLOW_EXAMPLE=examples/gpt/dpo_gpt.py rapidformer --user-script tests/scripts/slow_finetuner.py ...
"""

import importlib.util
import os
import time

from megatron_patch.training.engine import RapidformerEngine
from rapidformer import Finetuner

_example = os.environ.get("SLOW_EXAMPLE", "examples/gpt/finetune_gpt.py")
_spec = importlib.util.spec_from_file_location("example", os.path.join(os.path.dirname(__file__), "..", "..", _example))
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
[_trainer] = [value for value in vars(_module).values()
              if isinstance(value, type) and issubclass(value, Finetuner) and value.__module__ == "example"]
SLOW_FROM = int(os.environ["SLOW_FROM"])


class SlowFinetuner(_trainer):
    def run_forward_step(self, batch, model):
        # self.iteration counts finished steps: the one running now is self.iteration + 1.
        if self.iteration + 1 >= SLOW_FROM:
            time.sleep(0.2)
        return super().run_forward_step(batch, model)


SlowFinetuner(engine=RapidformerEngine()).train()
