"""Imports flow one way: the layer order is read from docs/DESIGN.md ("Layers", beside the module
map), and every import inside ``ds_mtraining`` (module-level or inside a function, found with
``ast``) must go to a module of its own layer or a lower one, with no import cycle at all. Also:
the module map and the layer table name the tree as it is."""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ds_mtraining"
DESIGN = ROOT / "docs" / "DESIGN.md"


# ---------------------------------------------------------------------- the checker
def read_layers(design: Path = DESIGN) -> list[list[str]]:
    """The layer table of docs/DESIGN.md ("### Layers"): lowest first, each a list of module or
    package names relative to the package (``__init__`` is the package's own ``__init__.py``)."""
    text = design.read_text()
    section = text.split("### Layers", 1)[1].split("\n#", 1)[0]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            layers[int(cells[0])] = re.findall(r"`([\w./]+)`", cells[1])
    assert layers and sorted(layers) == list(range(len(layers))), f"layers {sorted(layers)} in {design}"
    return [layers[n] for n in range(len(layers))]


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} of every module under root/ds_mtraining."""
    found = {}
    for path in (root / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports(name: str, tree: dict[str, tuple[Path, bool]]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its code (functions too):
    ``from X import y`` counts X.y when it is a module, else X."""
    path, is_package = tree[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in tree else module)
    return {m for m in found if m in tree and m != name}


def layer_of(name: str, layers: list[list[str]]) -> int | None:
    """The layer of the longest table entry that is ``name`` or a package holding it."""
    relative = name[len(PACKAGE) + 1:] if name != PACKAGE else "__init__"
    best = None
    for number, entries in enumerate(layers):
        for entry in entries:
            dotted = entry.replace("/", ".")
            if relative == dotted or relative.startswith(dotted + "."):
                if best is None or len(dotted) > best[1]:
                    best = (number, len(dotted))
    return None if best is None else best[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def check(root: Path = ROOT, layers: list[list[str]] | None = None) -> list[str]:
    """Every problem of the tree under ``root``: modules the table does not place, imports
    against the layer order, import cycles. Empty when the imports flow one way."""
    layers = read_layers() if layers is None else layers
    tree = modules(root)
    graph = {name: imports(name, tree) for name in tree}
    problems = [f"{name} is in no layer of docs/DESIGN.md" for name in sorted(tree) if layer_of(name, layers) is None]
    for name in sorted(graph):
        for other in sorted(graph[name]):
            mine, theirs = layer_of(name, layers), layer_of(other, layers)
            if mine is not None and theirs is not None and theirs > mine:
                problems.append(f"{name} (layer {mine}) imports {other} (layer {theirs})")
    problems += [f"import cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    return problems


# ---------------------------------------------------------------------- the tests
def test_imports_flow_one_way():
    assert check() == []


def test_every_layer_entry_exists():
    tree = modules(ROOT)
    for entries in read_layers():
        for entry in entries:
            name = PACKAGE if entry == "__init__" else f"{PACKAGE}.{entry.replace('/', '.')}"
            assert name in tree, f"docs/DESIGN.md's layer table names {entry}, which is not in the tree"


@pytest.fixture
def tree_copy(tmp_path):
    shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_planted_back_import_fails(tree_copy):
    """A function-level import of the training loop from the estimator's rule (a low layer
    reaching up) is caught, as is the cycle it closes."""
    rule = tree_copy / PACKAGE / "estimator" / "rule.py"
    rule.write_text(rule.read_text() + "\n\ndef planted():\n    from ..train import main\n    return main\n")
    problems = check(tree_copy)
    assert "ds_mtraining.estimator.rule (layer 5) imports ds_mtraining.train (layer 10)" in problems
    assert any(p.startswith("import cycle:") and "ds_mtraining.estimator.rule" in p for p in problems), problems


def test_a_cycle_within_one_layer_fails(tree_copy):
    """Two modules of one layer importing each other (here inside a function) are a cycle."""
    layout = tree_copy / PACKAGE / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef planted():\n    from . import passkey\n    return passkey\n")
    passkey = tree_copy / PACKAGE / "passkey.py"
    passkey.write_text(passkey.read_text() + "\n\ndef planted():\n    from .layout import StripedLayout\n"
                       "    return StripedLayout\n")
    assert check(tree_copy) == ["import cycle: ds_mtraining.layout <-> ds_mtraining.passkey"]


def test_an_unplaced_module_fails(tree_copy):
    (tree_copy / PACKAGE / "stray.py").write_text("X = 1\n")
    assert check(tree_copy) == ["ds_mtraining.stray is in no layer of docs/DESIGN.md"]


def test_the_module_map_matches_the_tree():
    """Every path the module map of docs/DESIGN.md names exists, and every top-level module and
    package of ds_mtraining (and every csrc/ folder holding files) is in it."""
    text = DESIGN.read_text()
    table = text.split("## Module map", 1)[1].split("\n#", 1)[0]
    named = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            named.update(re.findall(r"`([\w./*]+)`", re.sub(r"\(.*?\)", "", line.split("|")[1])))
    for path in named:
        where = ROOT / (path if path.startswith(("csrc", "op_builder")) else f"{PACKAGE}/{path}")
        assert list(where.parent.glob(where.name)), f"the module map names {path}, which is not in the tree"
    top = {p.name for p in (ROOT / PACKAGE).iterdir() if p.suffix == ".py" and p.name != "__init__.py"}
    top |= {p.name + "/" for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").is_file()}
    mentioned = {n.split("/")[0] + ("/" if "/" in n else "") for n in named}
    assert top <= mentioned, f"not in the module map: {sorted(top - mentioned)}"
    folders = {f"csrc/{p.relative_to(ROOT / 'csrc')}/" for p in (ROOT / "csrc").rglob("*")
               if p.is_dir() and any(f.is_file() for f in p.iterdir())}
    assert folders <= {n if n.endswith("/") else n + "/" for n in named}, \
        f"csrc folders not in the module map: {sorted(folders - named)}"
