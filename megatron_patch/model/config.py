"""Model configurations: one typed dataclass, a registry of named shapes, and Megatron's model flags on top.

Example::

    python pretrain.py --model-name llama3.2-1b --num-layers 4 --seq-length 2048   # a flag overrides the entry

    from megatron_patch.model.config import get_model_config
    config = get_model_config("qwen2-0.5b", num_layers=2)      # keyword overrides, validated again

GPT-2, LLaMA, Mistral, Qwen2 and Qwen3 are one GPT definition that differs in fields (normalization, position
embedding and its scaling, activation, biases, query/key norms, query groups, tied embeddings); Mixtral, Qwen2-MoE
and Qwen3-MoE are the same with mixture-of-experts MLPs (experts, top-k, shared expert, router options); BERT adds
token types, a binary head and the place of its layer norms. Field names follow megatron-core's ``TransformerConfig``
and Megatron-LM's flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import typing
from typing import Callable, Literal

from megatron_patch.flags import literal_choices


def layer_freq(text: str) -> int | list[int]:
    """``--moe-layer-freq``'s and ``--window-attn-skip-freq``'s value as Megatron-LM reads it (its
    ``moe_freq_type``): every N-th layer, or a Python list expression of 0s and 1s (evaluated from its syntax tree:
    list literals, ``*`` and ``+`` of integers, nothing else).

    Example::

        >>> layer_freq("2"), layer_freq("([0]*2+[1]*3)")
        (2, [0, 0, 1, 1, 1])
    """
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = value(node.left), value(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError(text)

    try:
        parsed = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a list such as ([0]*3+[1]*58)") from None
    return parsed


def parse_window_size(text: str) -> tuple[int, int]:
    """``--window-size``'s value: the keys a query sees before and after itself, ``LEFT,RIGHT`` (Megatron-LM's
    tuple, also written ``(LEFT, RIGHT)``).

    Example::

        >>> parse_window_size("511,0"), parse_window_size("(4095, 0)")
        ((511, 0), (4095, 0))
    """
    try:
        left, right = (int(part) for part in text.strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEFT,RIGHT (two integers, such as 4095,0)") from None
    return left, right


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where one ModelConfig field meets the world outside the model, declared once beside the field (``setting``)
    and read by everything that translates it: the command line, Megatron-LM's checkpoint args, megatron-core's
    TransformerConfig and the check that two checkpoints hold one model.

    Example::

        >>> s = SETTINGS["num_moe_experts"]
        >>> s.flag, s.megatron_lm, s.transformer, s.shape
        ('--num-experts', ('num_experts',), True, True)

    A field without one of these is translated by code that computes it (``activation`` is two Megatron-LM
    switches and a TransformerConfig function, ``family`` a model class).
    """

    name: str
    default: object
    """The field's default; ``dataclasses.MISSING`` for a field every model gives (``--num-layers``)."""
    flag: str | None
    """The value flag (``--field-name`` unless named otherwise); None for a field no value flag sets."""
    options: dict
    """The flag's argparse keywords: from the field's type (``int``, ``float``, a ``Literal``'s choices) unless
    given."""
    switches: dict
    """Switch flags and the value each sets (``{"--swiglu": "swiglu"}``)."""
    megatron_lm: tuple[str, ...]
    """Megatron-LM's ``args`` names holding the value as it is, the current one first (older ones are read when it
    is missing, and written too); none when the translation computes something."""
    megatron_lm_default: object
    """What a Megatron-LM run that stored no value used (megatron-core's default where it differs from ours)."""
    transformer: bool
    """Passed as it is to megatron-core's TransformerConfig under the same name."""
    feature: Literal["moe", "mla"] | None
    """Meaningful only in a mixture-of-experts or multi-latent-attention model: left out of TransformerConfig and
    Megatron-LM's args (None there) otherwise, and read from them only for such a model."""
    shape: bool
    """Fixes the model's family or a tensor's shape: two checkpoints that differ in it hold two models."""


def setting(default=dataclasses.MISSING, *, flag: bool | str = False, switches: dict | None = None,
            megatron_lm: bool | str | tuple[str, ...] = False, megatron_lm_default=dataclasses.MISSING,
            transformer: bool = False, feature: str | None = None, shape: bool = False, **options):
    """A ModelConfig field and its :class:`Setting` (``True`` for a name: the field's own, as a flag ``--field-name``).

    Example::

        num_layers: int = setting(flag=True, megatron_lm=True, transformer=True, shape=True)
        rope_scaling: bool = setting(False, switches={"--use-rope-scaling": True}, megatron_lm="use_rope_scaling")
    """
    how = dict(flag=flag, switches=switches or {}, megatron_lm=megatron_lm, megatron_lm_default=megatron_lm_default,
               transformer=transformer, feature=feature, shape=shape, options=options)
    return dataclasses.field(default=default, metadata={"setting": how})


def _settings(cls) -> dict[str, Setting]:
    """Each field's :class:`Setting`, the names and the flag's type resolved from the field."""
    hints = typing.get_type_hints(cls)
    found = {}
    for field in dataclasses.fields(cls):
        how = dict(field.metadata["setting"])
        names = how["megatron_lm"]
        names = (field.name,) if names is True else (names,) if isinstance(names, str) else tuple(names or ())
        flag = "--" + field.name.replace("_", "-") if how["flag"] is True else how["flag"] or None
        default = field.default if how["megatron_lm_default"] is dataclasses.MISSING else how["megatron_lm_default"]
        found[field.name] = Setting(
            name=field.name, default=field.default, flag=flag,
            options=how["options"] or (_flag_options(hints[field.name]) if flag else {}), switches=how["switches"],
            megatron_lm=names, megatron_lm_default=default, transformer=how["transformer"], feature=how["feature"],
            shape=how["shape"])
    return found


def _flag_options(hint) -> dict:
    """argparse's keywords for a field of type ``hint``: a Literal's choices, or the int or float it holds."""
    choices = literal_choices(hint)
    if choices:
        return choices
    (kind,) = {t for t in typing.get_args(hint) or (hint,) if t is not type(None)}
    return {"type": kind}


@dataclasses.dataclass
class ModelConfig:
    """The architecture of one model, independent of how it is parallelised.

    Example::

        >>> ModelConfig(family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32).kv_channels
        16

    ``ffn_hidden_size``, ``num_query_groups`` and ``kv_channels`` may be given as None: ``__post_init__`` sets
    them to megatron-core's default for the shape, so the fields always hold the sizes that are built.
    """

    family: Literal["gpt", "bert"] = setting(shape=True)
    """"gpt" builds megatron-core's GPTModel (causal LM), "bert" its BertModel (masked LM + binary head)."""
    num_layers: int = setting(flag=True, megatron_lm=True, transformer=True, shape=True)
    hidden_size: int = setting(flag=True, megatron_lm=True, transformer=True, shape=True)
    num_attention_heads: int = setting(flag=True, megatron_lm=True, transformer=True, shape=True)
    seq_length: int = setting(flag=True, megatron_lm=True)
    """Training sequence length (``--seq-length``)."""
    ffn_hidden_size: int | None = setting(None, flag=True, megatron_lm=True, transformer=True, shape=True)
    """MLP width; None becomes 4 x hidden_size (megatron-core's default)."""
    num_query_groups: int | None = setting(None, flag=True, transformer=True, shape=True)
    """Key/value heads for grouped-query attention (``--num-query-groups``); None becomes one per head (MHA)."""
    kv_channels: int | None = setting(None, flag=True, megatron_lm=True, transformer=True, shape=True)
    """Width of one attention head; None becomes hidden_size / num_attention_heads."""
    max_position_embeddings: int | None = setting(None, flag=True)
    """Rows of the learned position table (and the RoPE cache length); None means seq_length."""
    position_embedding_type: Literal["learned_absolute", "rope"] = setting("learned_absolute", flag=True, shape=True)
    rotary_base: int = setting(10000, flag=True, megatron_lm=True)
    """RoPE base period theta (LLaMA-2 10000, LLaMA-3 500000, Qwen2 1000000)."""
    rotary_percent: float = setting(1.0, flag=True, megatron_lm=True)
    """Fraction of each head's channels that RoPE rotates."""
    rope_scaling: bool = setting(False, switches={"--use-rope-scaling": True}, megatron_lm="use_rope_scaling")
    """LLaMA 3.1's RoPE frequency scaling (``--use-rope-scaling``, transformers' ``rope_type: llama3``).
    megatron-core's RotaryEmbedding._apply_scaling computes transformers' ``_compute_llama3_parameters`` with
    low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192 fixed (Meta's values); only
    the factor is a field."""
    rope_scaling_factor: float = setting(8.0, flag=True, megatron_lm=True)
    """The llama3 scaling ``factor`` (``--rope-scaling-factor``): 8 for LLaMA 3.1, 32 for LLaMA 3.2."""
    rotary_seq_len_interpolation_factor: float | None = setting(None, flag=True, megatron_lm=True)
    """Linear RoPE scaling (``--rotary-seq-len-interpolation-factor``; transformers' ``rope_type: linear``):
    positions divided by the factor. With ``rotary_base_local``, in the full-attention layers only (Gemma 3's 8)."""
    rotary_base_local: int | None = setting(None, flag=True)
    """RoPE base of the sliding-window layers where it differs from the full-attention layers' ``rotary_base``
    (``--rotary-base-local``; Gemma 3's ``rope_local_base_freq`` 10000 beside 1000000); None: one base."""
    normalization: Literal["LayerNorm", "RMSNorm"] = setting("LayerNorm", flag=True, megatron_lm=True,
        transformer=True, shape=True)
    layernorm_epsilon: float = setting(1e-5, flag="--norm-epsilon", megatron_lm=("norm_epsilon", "layernorm_epsilon"),
        transformer=True)
    activation: Literal["gelu", "gelu_tanh", "swiglu", "geglu"] = setting("gelu",
        switches={"--swiglu": "swiglu", "--openai-gelu": "gelu_tanh", "--geglu": "geglu"}, shape=True)
    """"gelu" is erf GeLU (BERT), "gelu_tanh" the tanh approximation GPT-2 was trained with (``--openai-gelu``),
    "swiglu" the gated SiLU MLP of LLaMA/Qwen2 (``--swiglu``), "geglu" the gated tanh-GeLU MLP of Gemma
    (``--geglu``)."""
    add_bias_linear: bool = setting(True, switches={"--disable-bias-linear": False}, megatron_lm=True, transformer=True)
    """Biases on every linear layer; ``--disable-bias-linear`` turns them off (LLaMA, Qwen2)."""
    add_qkv_bias: bool = setting(False, switches={"--add-qkv-bias": True}, megatron_lm=True, transformer=True,
        shape=True)
    """Bias on the fused q/k/v projection even without add_bias_linear (``--add-qkv-bias``, Qwen2)."""
    qk_layernorm: bool = setting(False, switches={"--qk-layernorm": True}, megatron_lm=True, transformer=True)
    """A norm (of ``normalization``'s kind) over each head's query and key, before RoPE (``--qk-layernorm``,
    Qwen3); megatron-core's ``q_layernorm``/``k_layernorm`` attention submodules."""
    window_size: tuple[int, int] | None = setting(None, flag=True, type=parse_window_size, metavar="LEFT,RIGHT",
        megatron_lm=True, transformer=True)
    """Sliding-window attention (``--window-size``, megatron-core's): a query sees LEFT keys before itself and RIGHT
    after (0 in a causal model); transformers' ``sliding_window`` is LEFT + 1. None: no window."""
    window_attn_skip_freq: int | list[int] | None = setting(None, flag=True, type=layer_freq,
        metavar="N|([1]*K+[0]*M)", megatron_lm=True, transformer=True)
    """Which layers keep full attention (``--window-attn-skip-freq``): every N-th for an int (N - 1 window layers to
    one full, Gemma 3's 6), or a 1 (window) / 0 (full) per layer; None: the window is in every layer."""
    softmax_scale: float | None = setting(None, flag=True, transformer=True)
    """The attention scores' scale (``--softmax-scale``); None is 1 / sqrt(kv_channels). Gemma 3's is
    ``query_pre_attn_scalar ** -0.5``."""
    untie_embeddings_and_output_weights: bool = setting(False,
        switches={"--untie-embeddings-and-output-weights": True}, megatron_lm=True, shape=True)
    """A separate output matrix instead of reusing the word embeddings (LLaMA, Qwen2 >= 7B)."""
    vocab_size: int | None = setting(None, shape=True)
    """Unpadded vocabulary; None when the tokenizer decides (see builder.padded_vocab_size)."""
    make_vocab_size_divisible_by: int = setting(128, flag=True, megatron_lm=True)
    hidden_dropout: float = setting(0.1, flag=True, megatron_lm=True, transformer=True)
    attention_dropout: float = setting(0.1, flag=True, megatron_lm=True, transformer=True)
    init_method_std: float = setting(0.02, flag=True, megatron_lm=True, transformer=True)
    num_tokentypes: int = setting(0)
    """BERT segment (token type) embeddings: 2 for sentence pairs, 0 for none."""
    add_binary_head: bool = setting(False, switches={"--bert-no-binary-head": False})
    """BERT's next-sentence / sentence-order head on the pooled first token (``--bert-no-binary-head`` = off)."""
    layernorm_zero_centered_gamma: bool = setting(False, switches={"--apply-layernorm-1p": True},
        megatron_lm="apply_layernorm_1p", transformer=True)
    """Norm weights store gamma - 1, initialised to 0 (``--apply-layernorm-1p``; megatron-core's
    ``layernorm_zero_centered_gamma``)."""
    sandwich_norm: bool = setting(False, switches={"--sandwich-norm": True}, shape=True)
    """A norm also on the attention's and the MLP's outputs, before each residual add (``--sandwich-norm``; Gemma
    2/3's ``post_attention_layernorm`` and ``post_feedforward_layernorm``, arXiv:2105.13290's sandwich LN)."""
    scale_embeddings: bool = setting(False, switches={"--scale-embeddings": True})
    """Word embeddings multiplied by sqrt(hidden_size) in their own dtype (``--scale-embeddings``, Gemma's)."""
    num_moe_experts: int | None = setting(None, flag="--num-experts", megatron_lm="num_experts", transformer=True,
        shape=True)
    """Experts in every layer's MLP (``--num-experts``); None is a dense model. megatron-core's MoELayer: a router,
    the routed experts and, with ``moe_shared_expert_intermediate_size``, a shared expert every token passes."""
    moe_router_topk: int = setting(2, feature="moe", flag=True, megatron_lm=True, transformer=True)
    """Experts each token is routed to (``--moe-router-topk``)."""
    moe_ffn_hidden_size: int | None = setting(None, feature="moe", flag=True, megatron_lm=True, transformer=True,
        shape=True)
    """Width of one routed expert's MLP (``--moe-ffn-hidden-size``); None becomes ffn_hidden_size in a MoE model."""
    moe_shared_expert_intermediate_size: int | None = setting(None, feature="moe", flag=True, megatron_lm=True,
        transformer=True, shape=True)
    """Width of the shared expert (``--moe-shared-expert-intermediate-size``, Qwen2-MoE); None: no shared expert."""
    moe_shared_expert_gate: bool = setting(False, feature="moe", switches={"--moe-shared-expert-gate": True},
        megatron_lm=True, transformer=True, shape=True)
    """A sigmoid gate on the shared expert's output (``--moe-shared-expert-gate``, Qwen2-MoE)."""
    moe_router_pre_softmax: bool = setting(False, feature="moe", switches={"--moe-router-pre-softmax": True},
        megatron_lm=True, transformer=True)
    """Softmax over all experts before the top-k, weights not renormalised (``--moe-router-pre-softmax``, Qwen2-MoE's
    ``norm_topk_prob: false``). Off: softmax over the k chosen logits, which equals Mixtral's and Qwen3-MoE's
    softmax-then-top-k-then-renormalise."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] = (
        setting("aux_loss", feature="moe", flag=True, megatron_lm=True, transformer=True))
    """The router's load balancing (``--moe-router-load-balancing-type``); "aux_loss" is Switch/Mixtral's loss."""
    moe_aux_loss_coeff: float = setting(0.0, feature="moe", flag=True, megatron_lm=True, transformer=True)
    """Weight of the load-balancing loss added to the LM loss (``--moe-aux-loss-coeff``; Mixtral 0.02, Qwen 0.001)."""
    moe_expert_capacity_factor: float | None = setting(None, feature="moe", flag=True, megatron_lm=True,
        transformer=True)
    """Tokens an expert takes, as a multiple of an even share (``--moe-expert-capacity-factor``); the rest are dropped
    by ``moe_token_drop_policy``. None: dropless (every routed token is computed)."""
    moe_pad_expert_input_to_capacity: bool = setting(False, feature="moe",
        switches={"--moe-pad-expert-input-to-capacity": True}, megatron_lm=True, transformer=True)
    """Pad every expert's input to its capacity (``--moe-pad-expert-input-to-capacity``; needs a capacity factor)."""
    moe_token_drop_policy: Literal["probs", "position"] = setting("probs", feature="moe", flag=True, megatron_lm=True,
        transformer=True)
    """Which tokens over capacity are dropped: lowest router probability, or last in the sequence."""
    moe_layer_freq: int | list[int] = setting(1, feature="moe", flag=True, type=layer_freq,
        metavar="N|([0]*K+[1]*M)", megatron_lm=True, transformer=True, shape=True)
    """Which layers are MoE layers (``--moe-layer-freq``): every N-th layer for an int, or one 0 (dense) / 1 (MoE)
    per layer, as Megatron-LM's ``"([0]*3+[1]*58)"`` gives DeepSeek-V3's first three dense layers
    (``first_k_dense_replace``). Dense layers have ``ffn_hidden_size``, experts ``moe_ffn_hidden_size``."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = setting("softmax", feature="moe", flag=True,
        megatron_lm=True, transformer=True)
    """The router's score (``--moe-router-score-function``): softmax (Mixtral, Qwen, DeepSeek-V2) or sigmoid with the
    chosen scores renormalised (DeepSeek-V3, Kimi K2, GLM-4.5)."""
    moe_router_enable_expert_bias: bool = setting(False, feature="moe",
        switches={"--moe-router-enable-expert-bias": True}, megatron_lm=True, transformer=True)
    """A per-expert bias added to the scores only to choose the experts, moved after each step towards balance
    without an auxiliary loss (``--moe-router-enable-expert-bias``; DeepSeek-V3's ``e_score_correction_bias``,
    arXiv:2408.15664)."""
    moe_router_bias_update_rate: float = setting(1e-3, feature="moe", flag=True, megatron_lm=True, transformer=True)
    """How far the expert bias moves per step (``--moe-router-bias-update-rate``)."""
    moe_router_num_groups: int | None = setting(None, feature="moe", flag=True, megatron_lm=True, transformer=True)
    """Expert groups for group-limited routing (``--moe-router-num-groups``, DeepSeek's ``n_group``)."""
    moe_router_group_topk: int | None = setting(None, feature="moe", flag=True, megatron_lm=True, transformer=True)
    """Groups a token may route to (``--moe-router-group-topk``, DeepSeek's ``topk_group``)."""
    moe_router_topk_scaling_factor: float | None = setting(None, feature="moe", flag=True, megatron_lm=True,
        transformer=True)
    """Factor on the routed experts' weights (``--moe-router-topk-scaling-factor``, DeepSeek's
    ``routed_scaling_factor``); None is 1."""
    multi_latent_attention: bool = setting(False, switches={"--multi-latent-attention": True}, megatron_lm=True,
        shape=True)
    """DeepSeek-V2/V3's multi-latent attention (``--multi-latent-attention``, arXiv:2405.04434): keys and values
    through a low-rank latent, a decoupled RoPE part of each head; megatron-core's ``MLASelfAttention``."""
    q_lora_rank: int | None = setting(None, feature="mla", flag=True, megatron_lm=True, transformer=True, shape=True)
    """Rank of the query's low-rank compression (``--q-lora-rank``); None projects the query directly (V2-Lite)."""
    kv_lora_rank: int = setting(512, feature="mla", flag=True, megatron_lm=True, transformer=True, shape=True)
    """Rank of the key/value latent (``--kv-lora-rank``)."""
    qk_head_dim: int = setting(128, feature="mla", flag=True, megatron_lm=True, transformer=True, shape=True)
    """Query/key channels per head without RoPE (``--qk-head-dim``, DeepSeek's ``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int = setting(64, feature="mla", flag=True, megatron_lm=True, transformer=True, shape=True)
    """Query/key channels per head with RoPE (``--qk-pos-emb-head-dim``, DeepSeek's ``qk_rope_head_dim``)."""
    v_head_dim: int = setting(128, feature="mla", flag=True, megatron_lm=True, transformer=True, shape=True)
    """Value channels per head (``--v-head-dim``)."""
    rope_type: Literal["rope", "yarn"] = setting("rope", feature="mla", flag=True, megatron_lm=True,
        megatron_lm_default="yarn", transformer=True)
    """RoPE of multi-latent attention (``--rope-type``): plain, or YaRN (arXiv:2309.00071) with the fields below."""
    rotary_scaling_factor: float = setting(1.0, feature="mla", flag=True, megatron_lm=True, megatron_lm_default=40.0,
        transformer=True)
    """YaRN's context extension factor (``--rotary-scaling-factor``; DeepSeek-V3 40)."""
    mscale: float = setting(1.0, feature="mla", flag=True, megatron_lm=True, transformer=True)
    """YaRN's attention-temperature coefficient (``--mscale``)."""
    mscale_all_dim: float = setting(0.0, feature="mla", flag=True, megatron_lm=True, transformer=True)
    """YaRN's softmax-scale coefficient (``--mscale-all-dim``); DeepSeek scales the softmax by its mscale squared."""
    original_max_position_embeddings: int = setting(4096, feature="mla", flag=True, megatron_lm=True, transformer=True)
    """The context YaRN extends (``--original-max-position-embeddings``)."""
    beta_fast: float = setting(32.0, feature="mla", flag=True, megatron_lm=True, transformer=True)
    """YaRN's fast boundary of the frequency ramp (``--beta-fast``)."""
    beta_slow: float = setting(1.0, feature="mla", flag=True, megatron_lm=True, transformer=True)
    """YaRN's slow boundary of the frequency ramp (``--beta-slow``)."""
    mtp_num_layers: int | None = setting(None, flag=True, transformer=True, shape=True)
    """Multi-token prediction modules after the last layer (``--mtp-num-layers``; DeepSeek-V3's 1,
    ``num_nextn_predict_layers``): module k predicts the token k + 1 ahead from the previous module's hidden state
    and that token's embedding, sharing the embedding and output layer (arXiv:2412.19437 2.2);
    megatron-core's ``MultiTokenPredictionBlock``, built on the last pipeline stage."""
    mtp_loss_scaling_factor: float = setting(0.1, flag=True, transformer=True)
    """Weight of the multi-token prediction losses' mean in the training loss (``--mtp-loss-scaling-factor``)."""
    bert_layernorm_style: Literal["pre", "post"] = setting("pre", flag=True)
    """"pre": Megatron's BERT (norm before attention/MLP, final norm). "post": original BERT as in Hugging Face
    ``BertModel`` (norm after each residual add, a norm on the embeddings, no final norm). Real BERT checkpoints
    only convert exactly into "post"."""

    def __post_init__(self):
        given = [name for name in _DERIVED_SIZES if getattr(self, name) is not None]
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", *given):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; set --kv-channels to choose the head width explicitly"
            )
        # Which sizes were derived is remembered so that `replace` derives them again from a new shape (a config
        # keeping gpt2-124m's 3072-wide MLP at hidden 64 would be neither model). An attribute, not a field: ==,
        # repr, dataclasses.asdict and megatron_patch_args.json leave it out.
        self._derived = frozenset(name for name in _DERIVED_SIZES if getattr(self, name) is None)
        if self.window_size is not None:  # a list once it has been through JSON
            self.window_size = tuple(self.window_size)
        for name in self._derived:
            setattr(self, name, _DERIVED_SIZES[name](self))
        self.validate()

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes``, like ``dataclasses.replace``, in which the sizes derived from the old shape
        are derived again from the new one; a size given explicitly (in ``changes`` or when this config was
        built) is kept.

        Example::

            >>> gpt2 = get_model_config("gpt2-124m")            # hidden 768, 12 heads, MLP 4 x 768
            >>> small = gpt2.replace(hidden_size=64, num_attention_heads=4)
            >>> small.ffn_hidden_size, small.num_query_groups, small.kv_channels
            (256, 4, 16)

        Plain ``dataclasses.replace`` keeps every size as it is, derived or not.
        """
        derive_again = {name: None for name in self._derived if name not in changes}
        return dataclasses.replace(self, **derive_again, **changes)

    def uses(self, feature: str | None) -> bool:
        """Whether this model has ``feature`` (a :class:`Setting`'s: "moe" experts, "mla" latent attention; None
        is every model's).

        Example::

            >>> get_model_config("tiny-mixtral").uses("moe"), get_model_config("tiny-mixtral").uses("mla")
            (True, False)
        """
        return {None: True, "moe": self.num_moe_experts is not None, "mla": self.multi_latent_attention}[feature]

    def settings(self, where: str) -> dict:
        """This model's fields that ``where`` (a :class:`Setting` attribute: "transformer", "shape") takes as they
        are, leaving out those of a feature the model lacks.

        Example::

            >>> get_model_config("tiny-llama").settings("transformer")["num_query_groups"]
            2
        """
        return {s.name: getattr(self, s.name) for s in SETTINGS.values() if getattr(s, where) and self.uses(s.feature)}

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP's first projection stacks a gate and an up projection (SwiGLU, GeGLU): megatron-core's
        ``gated_linear_unit``."""
        return self.activation in ("swiglu", "geglu")

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def validate(self) -> None:
        """Raise ValueError naming the flag when a field cannot describe a model (the sizes resolved)."""
        if self.family not in ("gpt", "bert"):
            raise ValueError(f"model family must be 'gpt' or 'bert', got {self.family!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by --num-query-groups "
                f"{self.num_query_groups}"
            )
        if self.max_positions < self.seq_length and self.position_embedding_type == "learned_absolute":
            raise ValueError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_positions}"
            )
        if self.family == "gpt" and (self.num_tokentypes or self.add_binary_head or self.bert_layernorm_style != "pre"):
            raise ValueError("num_tokentypes, add_binary_head and bert_layernorm_style are BERT-only settings")
        if self.bert_layernorm_style not in ("pre", "post"):
            raise ValueError(f"--bert-layernorm-style must be 'pre' or 'post', got {self.bert_layernorm_style!r}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.rope_scaling and self.position_embedding_type != "rope":
            raise ValueError("--use-rope-scaling scales RoPE frequencies; it needs --position-embedding-type rope")
        if self.rope_scaling and self.family != "gpt":
            raise ValueError("--use-rope-scaling is built into GPT models only")
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"--rope-scaling-factor must be positive, got {self.rope_scaling_factor}")
        self._validate_gemma()
        self._validate_moe()
        self._validate_mla()
        self._validate_mtp()

    def _validate_gemma(self) -> None:
        """Sliding windows, a RoPE base per layer kind, sandwich norms and scaled embeddings: GPT models only."""
        gpt_only = {"--window-size": self.window_size is not None, "--sandwich-norm": self.sandwich_norm,
                    "--scale-embeddings": self.scale_embeddings}
        if self.family != "gpt" and any(gpt_only.values()):
            raise ValueError(f"{' '.join(f for f, on in gpt_only.items() if on)} are built into GPT models only")
        if self.window_size is not None and (len(self.window_size) != 2 or self.window_size[0] < 0
                                             or self.window_size[1] != 0):
            raise ValueError(f"--window-size {self.window_size}: a causal model's window is LEFT,0 with LEFT >= 0 "
                             "keys before each query")
        skip = self.window_attn_skip_freq
        if skip is not None and self.window_size is None:
            raise ValueError("--window-attn-skip-freq says which layers skip the window; add --window-size")
        if skip is not None:
            self._check_layer_freq("--window-attn-skip-freq", skip, "a 1 (window) or 0 (full)")
        if self.rotary_base_local is not None and (self.window_size is None or self.position_embedding_type != "rope"
                                                   or self.multi_latent_attention):
            raise ValueError("--rotary-base-local is the RoPE base of sliding-window layers; it needs --window-size "
                             "and --position-embedding-type rope (without --multi-latent-attention)")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and (factor <= 0 or self.position_embedding_type != "rope"):
            raise ValueError(f"--rotary-seq-len-interpolation-factor {factor} must be positive, with "
                             "--position-embedding-type rope")
        if self.softmax_scale is not None and self.softmax_scale <= 0:
            raise ValueError(f"--softmax-scale must be positive, got {self.softmax_scale}")
        if self.sandwich_norm and self.num_moe_experts is not None:
            raise ValueError("--sandwich-norm puts a norm after dense MLPs only; drop it or --num-experts")

    def _check_layer_freq(self, flag: str, freq: int | list[int], per_layer: str) -> None:
        """A :func:`layer_freq` value: every N-th layer (N >= 1), or ``per_layer`` for each layer."""
        if isinstance(freq, list) and (len(freq) != self.num_layers or set(freq) - {0, 1}):
            raise ValueError(f"{flag} {freq} must give {per_layer} for each of the {self.num_layers} layers")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"{flag} must be at least 1, got {freq}")

    def _validate_moe(self) -> None:
        moe_only = {"moe_ffn_hidden_size": self.moe_ffn_hidden_size,
                    "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
                    "moe_expert_capacity_factor": self.moe_expert_capacity_factor}
        if self.num_moe_experts is None:
            given = [f"--{name.replace('_', '-')}" for name, value in moe_only.items() if value is not None]
            if given or self.moe_shared_expert_gate:
                raise ValueError(f"{' '.join(given) or '--moe-shared-expert-gate'} configures mixture-of-experts "
                                 "layers; add --num-experts or drop it")
            return
        if self.family != "gpt":
            raise ValueError("--num-experts: mixture-of-experts layers are built into GPT models only")
        if self.num_moe_experts < 1:
            raise ValueError(f"--num-experts must be at least 1, got {self.num_moe_experts}")
        if not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"--moe-router-topk {self.moe_router_topk} must be between 1 and --num-experts "
                             f"{self.num_moe_experts}")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ValueError(f"--moe-shared-expert-intermediate-size must be at least 1, got {shared}")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor must be positive, got {self.moe_expert_capacity_factor}")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ValueError("--moe-shared-expert-gate gates a shared expert; add "
                             "--moe-shared-expert-intermediate-size")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        self._check_layer_freq("--moe-layer-freq", self.moe_layer_freq, "a 0 (dense) or 1 (MoE)")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together; give both or neither")
        if groups is not None and (self.num_moe_experts % groups or not 1 <= group_topk <= groups
                                   or self.moe_router_topk % group_topk):
            raise ValueError(f"--moe-router-num-groups {groups} must divide --num-experts {self.num_moe_experts}, "
                             f"and --moe-router-group-topk {group_topk} be at most the groups and divide "
                             f"--moe-router-topk {self.moe_router_topk}")
        if self.moe_router_score_function == "sigmoid" and self.moe_router_pre_softmax:
            raise ValueError("--moe-router-pre-softmax is a softmax option; drop it with --moe-router-score-function "
                             "sigmoid")

    def _validate_mtp(self) -> None:
        if self.mtp_num_layers is None:
            return
        if self.family != "gpt" or self.mtp_num_layers < 1:
            raise ValueError(f"--mtp-num-layers {self.mtp_num_layers}: multi-token prediction needs at least one "
                             "module and a GPT model")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has experts, per ``moe_layer_freq`` (megatron-core's rule).

        Example::

            >>> get_model_config("tiny-deepseek-v3").is_moe_layer(0)
            False
        """
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer]) if isinstance(freq, list) else layer % freq == 0

    def is_window_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) attends through the sliding window, per ``window_attn_skip_freq``
        (megatron-core's rule, ``is_layer_window_attention``, which builds the model).

        Example::

            >>> m = get_model_config("tiny-llama", num_layers=7, window_size=(511, 0), window_attn_skip_freq=6)
            >>> [m.is_window_layer(i) for i in range(7)]
            [True, True, True, True, True, False, True]
        """
        if self.window_size is None:
            return False
        skip = self.window_attn_skip_freq
        return True if skip is None else bool(skip[layer]) if isinstance(skip, list) else (layer + 1) % skip != 0

    def _validate_mla(self) -> None:
        if not self.multi_latent_attention:
            if self.rope_type != "rope" or self.q_lora_rank is not None:
                raise ValueError("--rope-type yarn and --q-lora-rank configure multi-latent attention; add "
                                 "--multi-latent-attention")
            return
        if self.family != "gpt" or self.position_embedding_type != "rope":
            raise ValueError("--multi-latent-attention is built into GPT models with --position-embedding-type rope")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"--q-lora-rank must be at least 1, got {self.q_lora_rank}")
        if self.rope_scaling or self.rotary_percent != 1.0:
            raise ValueError("--use-rope-scaling and --rotary-percent are not used by multi-latent attention; its "
                             "RoPE is --rope-type rope or yarn over --qk-pos-emb-head-dim channels")


# The sizes a ModelConfig may leave None and the default ModelConfig.__post_init__ gives each: megatron-core's
# (TransformerConfig.__post_init__ in megatron/core/transformer/transformer_config.py at core_v0.16.1). Megatron-LM's
# validate_args narrows a --swiglu MLP without --ffn-hidden-size to 8/3 x hidden; ours stays 4 x hidden.
_DERIVED_SIZES: dict[str, Callable[[ModelConfig], int]] = {
    "ffn_hidden_size": lambda m: 4 * m.hidden_size,
    "num_query_groups": lambda m: m.num_attention_heads,
    "kv_channels": lambda m: m.hidden_size // m.num_attention_heads,
    # Only a MoE model has experts to size (megatron-core asserts None otherwise).
    "moe_ffn_hidden_size": lambda m: m.ffn_hidden_size if m.num_moe_experts else None,
}


SETTINGS: dict[str, Setting] = _settings(ModelConfig)


# ----------------------------------------------------------------------------------------------------------
# Registry of named configurations
# ----------------------------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[[], ModelConfig]] = {}


def register_model_config(name: str):
    """Register a zero-argument factory under ``name`` (decorator).

    Example::

        @register_model_config("my-gpt")
        def my_gpt():
            return ModelConfig(family="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    """

    def register(factory: Callable[[], ModelConfig]):
        if name in _REGISTRY:
            raise ValueError(f"model config {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return register


def list_model_configs() -> list[str]:
    """Names accepted by ``get_model_config`` / ``--model-name``, sorted."""
    return sorted(_REGISTRY)


def get_model_config(name: str, **overrides) -> ModelConfig:
    """The registered configuration ``name`` with ``overrides`` applied (and validated again); sizes the entry
    left to Megatron-LM's defaults follow an overridden shape (see ``ModelConfig.replace``).

    Example::

        >>> get_model_config("gpt2-124m", num_layers=2).num_layers
        2
        >>> get_model_config("gpt2-124m", hidden_size=64, num_attention_heads=4).ffn_hidden_size
        256
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; --model-name must be one of {list_model_configs()}") from None
    return factory().replace(**overrides)


# ----------------------------------------------------------------------------------------------------------
# Model types: what makes each Hugging Face model type, registered by its family's file (model/families/) and read by
# the named configurations and the converter (config.json in and out, which type a model without a config.json is)
# ----------------------------------------------------------------------------------------------------------

MODEL_TYPES: dict[str, dict] = {}
"""Hugging Face model_type -> the ModelConfig fields every model of that type has."""


def register_model_type(model_type: str, **fields) -> None:
    """Register the ModelConfig ``fields`` every model of Hugging Face's ``model_type`` has.

    Example::

        register_model_type("qwen2", **{**LLAMA_TYPE, "add_qkv_bias": True})
    """
    if model_type in MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is already registered")
    unknown = set(fields) - set(SETTINGS)
    if unknown:
        raise ValueError(f"model type {model_type!r}: {sorted(unknown)} are not ModelConfig fields")
    MODEL_TYPES[model_type] = fields


# config.json's keys for each size: LLaMA/BERT names first, then GPT-2's (n_layer, n_embd, ...) and T5's.
HF_SIZE_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "d_ff"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "vocab_size": ("vocab_size",),
}


def hf_size_key(hf_config: dict, field: str) -> str | None:
    """The key of ``hf_config`` (a config.json) that holds ModelConfig's ``field``, None where it has none.

    Example::

        >>> hf_size_key({"n_layer": 12}, "num_layers"), hf_size_key({"n_layer": 12}, "kv_channels")
        ('n_layer', None)
    """
    return next((key for key in HF_SIZE_KEYS[field] if hf_config.get(key) is not None), None)


def hf_sizes(hf_config: dict, optional: tuple[str, ...] = ("num_query_groups", "kv_channels")) -> dict:
    """The sizes of the model ``hf_config`` describes, as ModelConfig fields; a size it does not give raises
    KeyError naming config.json's key, unless ``optional``: then it is None, which ModelConfig derives as
    transformers does for every model type (one key/value head per query head, heads of hidden / heads channels;
    GPT-2 adds its MLP of 4 x hidden). The sequence length is the model's positions.

    Example::

        >>> sizes = hf_sizes({"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 32, "vocab_size": 128},
        ...                  optional=("num_query_groups", "kv_channels", "ffn_hidden_size"))
        >>> sizes["num_layers"], sizes["seq_length"], sizes["ffn_hidden_size"]
        (2, 32, None)
    """
    sizes = {}
    for field, keys in HF_SIZE_KEYS.items():
        key = hf_size_key(hf_config, field)
        if key is None and field not in optional:
            raise KeyError(keys[0])
        sizes[field] = hf_config[key] if key else None
    return {**sizes, "seq_length": sizes["max_position_embeddings"]}


def model_of_type(model_type: str, **fields) -> ModelConfig:
    """A ModelConfig of Hugging Face ``model_type``'s family with ``fields``.

    Example::

        >>> m = model_of_type("qwen2", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
        >>> m.normalization, m.add_qkv_bias
        ('RMSNorm', True)
    """
    return ModelConfig(**{**MODEL_TYPES[model_type], **fields})


def is_model_type(m: ModelConfig, model_type: str) -> bool:
    """Whether every field that makes ``model_type`` has its value in ``m`` (shapes, experts and defaults aside).

    Example::

        >>> qwen2 = get_model_config("tiny-qwen2")
        >>> is_model_type(qwen2, "qwen2"), is_model_type(qwen2, "llama")
        (True, False)
    """
    return all(getattr(m, field) == value for field, value in MODEL_TYPES[model_type].items())


# ----------------------------------------------------------------------------------------------------------
# Megatron-LM's model flags
# ----------------------------------------------------------------------------------------------------------

# Every model flag, made from the fields' settings: (flag, field, argparse keywords) and (switch, field, value it sets).
# A value flag defaults to None so that only what the user typed overrides the named configuration.
VALUE_FLAGS = [(s.flag, s.name, s.options) for s in SETTINGS.values() if s.flag]
SWITCH_FLAGS = [(flag, s.name, value) for s in SETTINGS.values() for flag, value in s.switches.items()]


def switch_name(flag: str) -> str:
    """Where a switch flag's value is kept: Megatron-LM's ``args`` name (``--swiglu`` -> ``swiglu``), which
    ``get_args()`` answers too, so ``model_config_from_args(get_args())`` reads the run's switches.

    Example::

        >>> switch_name("--untie-embeddings-and-output-weights")
        'untie_embeddings_and_output_weights'
    """
    return flag[2:].replace("-", "_")


def add_flag(parser, field: str, default=None) -> None:
    """Add the value flag of ModelConfig's ``field`` (its :class:`Setting`'s name and type) to ``parser``; by default
    None, so that only what the user typed overrides a named configuration.

    Example::

        add_flag(parser, "make_vocab_size_divisible_by", default=128)      # --make-vocab-size-divisible-by
    """
    setting = SETTINGS[field]
    parser.add_argument(setting.flag, dest=field, default=default, **setting.options)


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--model-name`` and Megatron-LM's model flags to ``parser``.

    Example::

        parser = add_model_arguments(argparse.ArgumentParser())
        config = model_config_from_args(parser.parse_args(["--model-name", "gpt2-124m", "--num-layers", "2"]))
    """
    group = parser.add_argument_group("model")
    group.add_argument("--model-name", choices=list_model_configs(), default=None,
                       help="start from this named configuration; the flags below override its fields")
    group.add_argument("--model-family", choices=["gpt", "bert"], default=None,
                       help="without --model-name: which model the flags describe (default gpt)")
    group.add_argument("--group-query-attention", action="store_true",
                       help="accepted for Megatron-LM compatibility; --num-query-groups alone enables GQA")
    for _, field, _ in VALUE_FLAGS:
        add_flag(group, field)
    for flag, field, value in SWITCH_FLAGS:
        group.add_argument(flag, dest=switch_name(flag), action="store_true",
                           help=f"sets {field}={value}")
    return parser


def model_flag_values(args: argparse.Namespace) -> dict:
    """The ModelConfig fields ``args`` sets: the value flags given and the switches on.

    Example::

        >>> parser = add_model_arguments(argparse.ArgumentParser())
        >>> model_flag_values(parser.parse_args(["--num-layers", "2", "--swiglu"]))
        {'num_layers': 2, 'activation': 'swiglu'}
    """
    values = {field: getattr(args, field) for _, field, _ in VALUE_FLAGS if getattr(args, field) is not None}
    for flag, field, value in SWITCH_FLAGS:
        if getattr(args, switch_name(flag)):
            values[field] = value
    return values


def model_config_from_flags(values: dict, name: str | None = None, family: str | None = None,
                            vocab_size: int | None = None) -> ModelConfig:
    """The configuration ``name`` (or one from ``values`` alone) with the field ``values`` applied.

    Example::

        >>> model_config_from_flags({"rotary_base": 500000}, name="tiny-llama").rotary_base
        500000
    """
    overrides = dict(values)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if name is not None:
        return get_model_config(name, **overrides)
    missing = [f"--{f.replace('_', '-')}" for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
               if f not in overrides]
    if missing:
        raise ValueError(f"without --model-name the model needs {' '.join(missing)}")
    return ModelConfig(family=family or "gpt", **overrides)


def model_config_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> ModelConfig:
    """The configuration named by ``--model-name`` (or built from the flags alone), with the flags applied.

    Example::

        >>> parser = add_model_arguments(argparse.ArgumentParser())
        >>> args = parser.parse_args(["--model-name", "tiny-llama", "--rotary-base", "500000"])
        >>> model_config_from_args(args).rotary_base
        500000
    """
    return model_config_from_flags(model_flag_values(args), args.model_name, args.model_family, vocab_size)
