r"""How megatron-core names the tensors of the models built here, below both the layer specs (``specs.py``) and
the checkpoint formats (``checkpoint/``), which read the same names.

Example::

    >>> LAYER.sub(r"\1{}.", "decoder.layers.3.mlp.linear_fc1.weight")
    'decoder.layers.{}.mlp.linear_fc1.weight'
    >>> FUSED_NORM_NAMES["input_layernorm."]
    'self_attention.linear_qkv.layer_norm_'

Tensors are named as in megatron-core's TP=1, PP=1 model, layers numbered across all pipeline stages.
"""

import re

LAYER = re.compile(r"^((?:decoder|encoder)\.layers\.)(\d+)\.")
"""A layer's tensor name: group 1 up to the layer number, group 2 the number."""
# Where Transformer Engine fuses a pre-norm into the linear layer after it, the norm's tensors are that layer's:
# megatron-core's local name on the left, TE's on the right (megatron-core's get_gpt_layer_local_spec maps them
# so for torch_dist; the per-rank format keeps whichever the writer's layers had).
FUSED_NORM_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
