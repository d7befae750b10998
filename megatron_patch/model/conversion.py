"""Conversion as data: per Hugging Face ``model_type``, how its config and its tensors map onto megatron-core. Each
family registers its own in its file under ``megatron_patch/model/families/``.

Example::

    from megatron_patch.model.conversion import family_for
    family = family_for({"model_type": "llama", ...})        # the registry, keyed by config.json's model_type
    model_config = family.config_from_hf(hf_config)
    table = family.table(model_config, "LlamaForCausalLM")
    table.rules[3]   # Rule(hf=('model.layers.{}.self_attn.q_proj.weight', ...), mcore='decoder.layers.{}...')

A rule names the Hugging Face tensor(s), the megatron-core tensor (names of a TP=1, PP=1, EP=1 model's
``state_dict()``; ``{}`` is the layer index) and the transforms between them (``convert/transforms.py``'s
``TRANSFORMS``, by name). Nothing here branches on a model's name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_patch.errors import UserError
from megatron_patch.model.config import ModelConfig


class UnsupportedCheckpoint(UserError, ValueError):
    """The input is not something this converter can translate exactly (model type, architecture, option)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """Hugging Face tensor name(s) <-> one megatron-core tensor name, through named transforms."""

    hf: tuple[str, ...]
    mcore: str
    transforms: tuple[str, ...] = ()

    def expand(self, num_layers: int) -> list["Rule"]:
        """One rule per layer when the names carry ``{}``; the rule itself otherwise."""
        if "{}" not in self.mcore:
            return [self]
        return [Rule(tuple(n.format(i) for n in self.hf), self.mcore.format(i), self.transforms)
                for i in range(num_layers)]


def rule(hf: str | tuple[str, ...], mcore: str, *transforms: str) -> Rule:
    return Rule(hf if isinstance(hf, tuple) else (hf,), mcore, transforms)


@dataclasses.dataclass(frozen=True)
class Table:
    """The rules of one Hugging Face architecture, what its files may hold besides them, and the megatron
    tensors it cannot provide (heads an encoder-only checkpoint does not have: initialised and reported)."""

    rules: tuple[Rule, ...]
    ignored_hf: tuple[str, ...] = ()
    missing_mcore_prefixes: tuple[str, ...] = ()

    def expanded(self, num_layers: int) -> list[Rule]:
        return [r for template in self.rules for r in template.expand(num_layers)]


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything model-type specific about a conversion."""

    model_type: str
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    table: Callable[[ModelConfig, str], Table]
    architectures: tuple[str, ...]
    recognises: Callable[[ModelConfig], bool] | None = None
    """Whether a model that records no Hugging Face config (trained from scratch, or saved by Megatron-LM) is this
    model type; None for a type only ``--model-type`` picks (a Mistral model without its window is a LLaMA one)."""
    held_by_files: Callable[[ModelConfig, list[str]], ModelConfig] | None = None
    """The config changed by what the weight files hold, for layers config.json announces but checkpoints may lack
    (DeepSeek-V3's multi-token prediction layers: the published checkpoint has them, transformers saves none)."""
    zero_centered_norms: bool = False
    """Its Hugging Face norms hold gamma - 1, as ours do with ``layernorm_zero_centered_gamma`` (Gemma's); the others'
    hold gamma, so exporting a model trained with ``--apply-layernorm-1p`` to them adds 1."""
    outputs: dict[str, dict[str, str]] | None = None
    """What verify compares, per architecture: our output's name -> the attribute of the Hugging Face model's output
    (None: each architecture's ``logits``)."""

    def compared_outputs(self, architecture: str) -> dict[str, str]:
        return (self.outputs or {}).get(architecture, {"logits": "logits"})


FAMILIES: dict[str, Family] = {}


def register_family(**fields) -> Family:
    """Register the conversion of one Hugging Face model type, given by :class:`Family`'s fields.

    Example::

        register_family(model_type="gpt2", config_from_hf=_gpt2_config, config_to_hf=_gpt2_hf, table=_gpt2_table,
                        architectures=("GPT2LMHeadModel",), recognises=_is_gpt2)
    """
    family = Family(**fields)
    if family.model_type in FAMILIES:
        raise ValueError(f"a converter for model_type {family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family
    return family


def family_for(hf_config: dict) -> Family:
    """The converter registered for ``hf_config["model_type"]``, or an error listing the supported ones."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedCheckpoint(
            f"config.json has model_type {model_type!r}; supported model types are {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


def recognised_model_type(m: ModelConfig) -> str | None:
    """The one model type whose ``recognises`` accepts ``m``, else None (the model needs ``--model-type``).

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> recognised_model_type(get_model_config("tiny-llama")), recognised_model_type(get_model_config("tiny-gpt2"))
        ('llama', 'gpt2')
        >>> recognised_model_type(get_model_config("tiny-llama", normalization="LayerNorm")) is None
        True
    """
    found = [f.model_type for f in FAMILIES.values() if f.recognises is not None and f.recognises(m)]
    return found[0] if len(found) == 1 else None


def recognised_model_types() -> list[str]:
    """The model types :func:`recognised_model_type` can return.

    Example::

        >>> recognised_model_types()
        ['gpt2', 'llama']
    """
    return sorted(f.model_type for f in FAMILIES.values() if f.recognises is not None)


def compared_outputs(architecture: str) -> dict[str, str]:
    """What verify compares for the Hugging Face class ``architecture``: our output -> its output's attribute.

    Example::

        >>> compared_outputs("BertModel"), compared_outputs("LlamaForCausalLM")
        ({'hidden_states': 'last_hidden_state'}, {'logits': 'logits'})
    """
    [family] = [f for f in FAMILIES.values() if architecture in f.architectures]
    return family.compared_outputs(architecture)


def architecture_of(hf_config: dict, family: Family) -> str:
    """The Hugging Face class the checkpoint was saved from (``architectures[0]``), checked against the family."""
    architectures = hf_config.get("architectures") or [family.architectures[0]]
    if architectures[0] not in family.architectures:
        raise UnsupportedCheckpoint(
            f"config.json architecture {architectures[0]!r} is not supported for model_type "
            f"{family.model_type!r}; supported: {list(family.architectures)}"
        )
    return architectures[0]


def require(hf_config: dict, key: str, allowed, default=None) -> None:
    value = hf_config.get(key, default)
    if value not in allowed:
        raise UnsupportedCheckpoint(
            f"config.json has {key}={value!r}; the {hf_config.get('model_type')} converter supports {list(allowed)}"
        )
