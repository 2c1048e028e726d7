"""The package's layers import only downward, and no modules import each other in a cycle.

Every module's imports are read with ``ast`` (those inside functions too), resolved to
seqpack modules, and checked against the layer order below; a new subpackage must be
given its place here before it can pass.
"""

import ast
import importlib.machinery
from pathlib import Path

import pytest

import seqpack

PACKAGE = Path(seqpack.__file__).resolve().parent

#: Lowest first. A module may import its own layer and any layer listed before it.
LAYERS = [
    ("seqpack.errors", "seqpack._arguments", "seqpack._read_only", "seqpack._threads", "seqpack._openmp",
     "seqpack.fixtures"),
    ("seqpack.data",),
    ("seqpack.layout",),
    ("seqpack.packing",),
    ("seqpack.io",),
    ("seqpack.nn",),
    ("seqpack.torch",),
    ("seqpack.hf",),
    ("seqpack.ray",),
    ("seqpack.chapters",),
    ("seqpack.bench",),
    ("seqpack.cli", "seqpack.__main__", "seqpack"),
]


def layer_of(module: str) -> int:
    """The index of the layer that owns ``module`` (its longest listed prefix)."""
    best, rank = -1, None
    for index, names in enumerate(LAYERS):
        for name in names:
            within = module.startswith(name + ".") and name != "seqpack"  # the root owns itself only
            if (module == name or within) and len(name) > best:
                best, rank = len(name), index
    if rank is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return rank


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def compiled_modules() -> set[str]:
    """The package's compiled kernels (no source to read, but importable by name)."""
    found = set()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for path in PACKAGE.rglob("*" + suffix):
            parts = path.relative_to(PACKAGE.parent).parts
            found.add(".".join(parts[:-1] + (path.name[: -len(suffix)],)))
    return found


def imports_of(name: str, path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """``(imported seqpack module, at module level)`` for every import in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from . import x`` may name a submodule x.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            if target == "seqpack" or target.startswith("seqpack."):
                while target not in known and "." in target:  # names inside a module, compiled kernels
                    target = target.rsplit(".", 1)[0]
                found.append((target, id(node) in top_level))
    return found


def test_layers_import_only_downward():
    found = modules()
    known = set(found) | compiled_modules()
    upward = []
    for name, path in found.items():
        for target, _ in imports_of(name, path, known):
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(upward)
    assert len(found) > 30 and "seqpack.nn._attention" in known  # the walk really read the package


def test_no_import_cycles():
    """Module-level imports between seqpack modules form no cycle (a package's
    ``__init__`` importing its own modules is the one expected edge)."""
    found = modules()
    known = set(found)
    graph = {name: set() for name in found}
    for name, path in found.items():
        for target, top in imports_of(name, path, known):
            if top and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_check_catches_an_upward_import(tmp_path):
    """Negative control: a data module importing the packing layer is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from ..packing import pack\n")
    targets = [t for t, _ in imports_of("seqpack.data.bad", bad, set(modules()))]
    assert targets == ["seqpack.packing"] and layer_of(targets[0]) > layer_of("seqpack.data.bad")
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("seqpack.nowhere")
