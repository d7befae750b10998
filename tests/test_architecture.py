"""The package's layering, read from the source: the trainer and the converter share the checkpoint format
(``megatron_patch.checkpoint``) and never import each other; the format imports neither.

Example::

    python -m pytest -q tests/test_architecture.py

Every import counts: at module level or inside a function, absolute or relative, ``from megatron_patch import
convert``, and ``importlib.import_module("megatron_patch.convert...")`` with a literal name.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "megatron_patch"

# package under megatron_patch -> the packages it must not import
FORBIDDEN = {
    "training": ("convert",),
    "convert": ("training",),
    "checkpoint": ("training", "convert"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the text of ``module``) imports, as absolute dotted names; ``from a import b``
    yields both ``a`` and ``a.b`` (b may be a submodule).

    Example::

        >>> sorted(imported_modules("from .. import convert", "megatron_patch.training.models"))
        ['megatron_patch', 'megatron_patch.convert']
    """
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in
                   ("import_module", "__import__"))):
            found.add(node.args[0].value)
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    problems = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        module = _module_name(path)
        for name in sorted(imported_modules(path.read_text(), module, path.name == "__init__.py")):
            if any(_within(name, f"megatron_patch.{other}") for other in forbidden):
                problems.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return problems


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_none_of_its_forbidden_packages(layer):
    assert (PACKAGE / layer).is_dir()
    assert _violations(layer, FORBIDDEN[layer]) == []


@pytest.mark.parametrize("source", [
    "from megatron_patch.convert.core import hf_to_megatron",
    "import megatron_patch.convert.verify",
    "from megatron_patch import convert",
    "from ..convert import core",
    "from .. import convert",
    "def load():\n    from megatron_patch.convert.verify import load_into_chunks",
    "import importlib\nimportlib.import_module('megatron_patch.convert.cli')",
])
def test_every_form_of_import_is_seen(source):
    """The check above would pass on a checker that sees nothing; each of these imports must be caught."""
    assert any(_within(name, "megatron_patch.convert")
               for name in imported_modules(source, "megatron_patch.training.models"))


def test_an_unrelated_import_is_not_taken_for_a_forbidden_one():
    names = imported_modules("from megatron_patch.convert_utils import x\nimport megatron_patch.checkpoint",
                             "megatron_patch.training.models")
    assert not any(_within(name, "megatron_patch.convert") for name in names)
