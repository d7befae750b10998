"""Flags declared where their value lives: a dataclass field's ``flag(...)`` gives its command-line names and
argparse options, and the parser is generated from the fields (``add_flags``). The run's sections
(``training/config.py``) and the parallel layout (``model/parallel.py``) declare theirs this way; ModelConfig's
``setting(...)`` adds what a model field also needs (Megatron-LM's name, TransformerConfig's).

Example::

    @dataclasses.dataclass(frozen=True)
    class CheckpointConfig:
        save: str | None = flag()                                   # --save
        save_interval: int | None = flag(type=int)                  # --save-interval

    add_flags(parser, CheckpointConfig, "checkpointing")
    config = from_flags(CheckpointConfig, vars(parser.parse_args()))
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal


def flag(*names: str, default=None, unset=dataclasses.MISSING, **options):
    """A field set by the command line: its flags (``--field-name`` when none are named), default and argparse
    options; a False default makes it a switch. ``unset`` is what the parsed flags hold when it is not given, where
    that must differ from the default (the launcher tells an asked-for value from the default by it).

    Example::

        lr: float = flag(default=1e-4, type=float)          # --lr
        local_rank: int | None = flag("--local-rank", "--local_rank", type=int)
    """
    parsed = default if unset is dataclasses.MISSING else unset
    return dataclasses.field(default=default, metadata={"flags": names, "options": options, "unset": parsed})


def add_flags(parser, section, title: str, description: str | None = None) -> None:
    """Add one argument per flagged field of the dataclass ``section`` to the argparse ``parser`` (its ``dest`` is
    the field's name, which is also the name Megatron-LM's ``args`` carry).

    Example::

        add_flags(parser, CheckpointConfig, "checkpointing")    # --save, --load, --save-interval, ...
    """
    group = parser.add_argument_group(title, description)
    hints = typing.get_type_hints(section)
    for field in dataclasses.fields(section):
        if "flags" not in field.metadata:
            continue
        options = {**literal_choices(hints[field.name]), **field.metadata["options"]}
        if field.default is False:
            options.setdefault("action", "store_true")
        names = field.metadata["flags"] or ("--" + field.name.replace("_", "-"),)
        group.add_argument(*names, dest=field.name, default=field.metadata["unset"], **options)


def literal_choices(hint) -> dict:
    """``{"choices": [...]}`` for a field typed by a ``Literal`` (or an optional one), so that a flag's choices are
    written once, in its type; ``{}`` for any other type.

    Example::

        >>> literal_choices(Literal["full", "selective"] | None)
        {'choices': ['full', 'selective']}
    """
    members = typing.get_args(hint) if typing.get_origin(hint) is not Literal else (hint,)
    choices = [value for member in members if typing.get_origin(member) is Literal
               for value in typing.get_args(member)]
    return {"choices": choices} if choices else {}


def from_flags(section, values: dict, **derived):
    """``section`` built from parsed flag ``values`` (a dict: the parsed Namespace is never changed) and the
    ``derived`` fields; argparse's lists become tuples, so the configuration stays hashable and frozen."""
    fields = {f.name: values[f.name] for f in dataclasses.fields(section) if "flags" in f.metadata}
    fields = {name: tuple(v) if isinstance(v, list) else v for name, v in fields.items()}
    return section(**{**fields, **derived})
