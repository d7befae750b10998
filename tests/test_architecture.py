"""The package's layering, read from the source: its floors (``FLOORS``), each importing only from its own floor
and those below; the trainer and the converter share the checkpoint format (``megatron_patch.checkpoint``) and never
import each other; the format imports neither; the training backends leave every checkpoint file to it.

Example::

    python -m pytest -q tests/test_architecture.py

Every import counts: at module level or inside a function, absolute or relative, ``from megatron_patch import
convert``, and ``importlib.import_module("megatron_patch.convert...")`` with a literal name. No two modules import each
other, directly or through others (``import_cycles``), inside a function either: such an import only hides the cycle.
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

# The package's floors, bottom up: a module imports from its own floor and the ones below, never from one above (the
# model knows nothing of checkpoints, checkpoints nothing of training). A module belongs to the most specific name
# listed: convert/cli.py and training/reshard.py are entry points like megatron_patch.cli, whose runner and launcher
# they use. The package itself (megatron_patch/__init__.py), which every import of a module under it runs first, is
# on the ground floor.
FLOORS = (
    ("", "errors", "compat", "startup", "staging", "layout", "unpickle", "flags"),
    ("tokenizer", "distributed"),
    ("model", "data"),
    ("checkpoint",),
    ("training", "convert"),
    ("cli", "convert.cli", "training.reshard", "quickstart", "testing"),
)

# Calls that read or write files, by full name ("x." for everything under x), and methods that do: under
# training/backends/ none, the checkpoint files being checkpoint/'s (issue 36).
FILE_IO = ("open", "io.open", "os.open", "os.replace", "os.rename", "os.remove", "os.unlink", "os.makedirs",
           "os.mkdir", "os.rmdir", "os.listdir", "os.scandir", "os.walk", "shutil.", "torch.save", "torch.load",
           "torch.distributed.checkpoint.save", "torch.distributed.checkpoint.load", "safetensors.",
           "megatron.core.dist_checkpointing.save", "megatron.core.dist_checkpointing.load")
FILE_IO_METHODS = ("save_pretrained", "from_pretrained")


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
    found = set()
    for origin, names in _imports(source, module, is_package):
        found.add(origin)
        found.update(f"{origin}.{name}" for name in names)
    return found


def _imports(source: str, module: str, is_package: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """Each import of ``source`` as (the absolute module it names, the names taken from it): ``import a.b`` is
    ``("a.b", ())``, ``from .a import b, c`` in package ``p`` is ``("p.a", ("b", "c"))``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            found.append((origin, tuple(alias.name for alias in node.names)))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) in
                   ("import_module", "__import__"))):
            found.append((node.args[0].value, ()))
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


def floor_of(module: str) -> int | None:
    """The floor in ``FLOORS`` of a module (or a name imported from it) under megatron_patch; None if it has none.

    Example::

        >>> floor_of("megatron_patch.convert.cli.main"), floor_of("megatron_patch.convert.core")
        (5, 4)
        >>> floor_of("megatron_patch"), floor_of("megatron_patch.unplanned")
        (0, None)
    """
    parts = module.split(".")[1:]
    for name in [".".join(parts[:length]) for length in range(len(parts), 0, -1)] or [""]:
        for floor, names in enumerate(FLOORS):
            if name in names:
                return floor
    return None


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The modules under megatron_patch that ``source`` (the text of ``module``) imports from a floor above its own.

    Example::

        >>> upward_imports("from megatron_patch.checkpoint.format import ARGS_FILE", "megatron_patch.model.specs")
        ['megatron_patch.checkpoint.format', 'megatron_patch.checkpoint.format.ARGS_FILE']
    """
    own = floor_of(module)
    return sorted(name for name in imported_modules(source, module, is_package)
                  if _within(name, "megatron_patch") and (floor_of(name) or 0) > own)


def test_every_module_is_on_a_floor():
    assert [_module_name(path) for path in sorted(PACKAGE.rglob("*.py"))
            if floor_of(_module_name(path)) is None] == []


def test_a_new_package_is_on_no_floor_until_it_is_given_one():
    """The check above would pass if every name fell to the package's own floor."""
    assert floor_of("megatron_patch.unplanned.module") is None and floor_of("megatron_patch") == 0


def test_no_module_imports_from_a_floor_above_its_own():
    problems = [f"{path.relative_to(PACKAGE.parent)} imports {name}"
                for path in sorted(PACKAGE.rglob("*.py"))
                for name in upward_imports(path.read_text(), _module_name(path), path.name == "__init__.py")]
    assert problems == []


@pytest.mark.parametrize("source, module", [
    ("from megatron_patch.checkpoint.format import FUSED_NORM_NAMES", "megatron_patch.model.specs"),
    ("from megatron_patch.training.config import RunConfig", "megatron_patch.checkpoint.megatron"),
    ("from ..training import config", "megatron_patch.checkpoint.plain"),
    ("from megatron_patch.cli import launch", "megatron_patch.convert.core"),
    ("import megatron_patch.model.config", "megatron_patch.errors"),
])
def test_an_import_from_above_is_seen(source, module):
    """The check above would pass on a table that puts everything on one floor; each of these must be caught."""
    assert upward_imports(source, module)


def file_io_calls(source: str) -> list[str]:
    """The calls in ``source`` that read or write files (``FILE_IO``, ``FILE_IO_METHODS``), as ``line N: name``;
    a name is resolved through the module's imports (``from shutil import rmtree`` makes ``rmtree`` shutil's).

    Example::

        >>> file_io_calls("from megatron.core import dist_checkpointing\\ndist_checkpointing.save(state, path)")
        ['line 2: dist_checkpointing.save']
    """
    tree = ast.parse(source)
    origins = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.partition(".")[0]
                origins[bound] = alias.name if alias.asname else bound
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                origins[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
        name = _dotted(node.func)
        head, _, rest = (name or "").partition(".")
        full = origins.get(head, head) + (f".{rest}" if rest else "")
        method = isinstance(node.func, ast.Attribute) and node.func.attr in FILE_IO_METHODS
        if method or (name and any(full == io or (io.endswith(".") and full.startswith(io)) for io in FILE_IO)):
            found.append(f"line {node.lineno}: {name or node.func.attr}")
    return found


def _dotted(node) -> str | None:
    """``a.b.c`` for a chain of names and attributes; None for anything else (a call's result, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def test_the_training_backends_leave_checkpoint_files_to_checkpoint():
    backends = sorted((PACKAGE / "training" / "backends").rglob("*.py"))
    assert backends
    assert {str(path.relative_to(PACKAGE.parent)): calls for path in backends
            if (calls := file_io_calls(path.read_text()))} == {}


@pytest.mark.parametrize("source", [
    "with open(path, 'w') as f:\n    f.write(text)",
    "import os\nos.replace(staging, path)",
    "import os\nos.makedirs(path, exist_ok=True)",
    "import os as system\nsystem.listdir(root)",
    "import shutil\nshutil.rmtree(path)",
    "from shutil import rmtree\nrmtree(path)",
    "import torch\ntorch.save(state, path)",
    "import torch\nstate = torch.load(path, weights_only=True)",
    "from megatron.core import dist_checkpointing\ndist_checkpointing.load(state, path)",
    "module.save_pretrained(path, state_dict=state)",
    "type(module).from_pretrained(path)",
])
def test_file_io_is_seen(source):
    """The check above would pass on a checker that sees nothing; each of these must be caught."""
    assert file_io_calls(source)


def test_a_call_that_touches_no_file_is_not_taken_for_file_io():
    assert file_io_calls("import os\nimport torch\nos.environ.get('RANK')\ntorch.distributed.barrier()\n"
                         "optimizer.load_state_dict(state)\nscheduler.state_dict()") == []


def import_cycles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others, among ``sources`` (module name ->
    (its text, whether it is a package's ``__init__``)), each sorted. ``from a import b`` is an import of module
    ``a.b`` where there is one, else of ``a``; a module's parent packages, which Python imports before it, count only
    where it imports them by name.

    Example::

        >>> import_cycles({"p.a": ("from p import b", False), "p.b": ("def f():\\n    import p.a", False)})
        [['p.a', 'p.b']]
    """
    graph = {}
    for module, (source, is_package) in sources.items():
        edges = set()
        for origin, names in _imports(source, module, is_package):
            submodules = {f"{origin}.{name}" for name in names} & sources.keys()
            edges |= submodules if submodules and len(submodules) == len(names) else submodules | {origin}
        graph[module] = sorted(edges & sources.keys() - {module})
    # Tarjan's strongly connected components.
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for imported in graph[module]:
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(cycles)


def test_no_modules_import_each_other():
    sources = {_module_name(path): (path.read_text(), path.name == "__init__.py") for path in PACKAGE.rglob("*.py")}
    assert import_cycles(sources) == []


@pytest.mark.parametrize("sources", [
    {"p.a": ("import p.b", False), "p.b": ("import p.a", False)},
    {"p.a": ("def f():\n    from p import b", False), "p.b": ("from . import a", False)},
    {"p.a": ("from p.b import f", False), "p.b": ("from p.c import g", False), "p.c": ("import p.a", False)},
    {"p": ("from p.a import f", True), "p.a": ("import importlib\nimportlib.import_module('p')", False)},
])
def test_an_import_cycle_is_seen(sources):
    """The check above would pass on a checker that sees nothing; each of these cycles must be caught."""
    assert import_cycles(sources) == [sorted(sources)]


def test_importing_a_package_and_its_module_is_no_cycle():
    """``from p import a`` in ``p.b`` imports module ``p.a``, not package ``p`` (whose ``__init__`` imports ``p.b``)."""
    assert import_cycles({"p": ("from p.b import f", True), "p.a": ("", False),
                          "p.b": ("from p import a", False)}) == []
