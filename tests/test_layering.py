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


# ---------------------------------------------------------------------- the ring and the step clock
TRAINING = ("ds_mtraining.train", "ds_mtraining.training", "ds_mtraining.integration")
STEP = "ds_mtraining.step"
ADVANCING = "new_step"  # what starts a training step: defined in step.py only, called from above the ring


def ring_problems(root: Path = ROOT) -> list[str]:
    """What ``ring/`` may not do: import the training loop (``train``, ``training/``,
    ``integration``), directly or through anything it imports; take the step clock's advancing
    half (it reads ``step.current_step`` only); define or name a ``new_step`` of its own. Also:
    ``new_step`` is defined once in the package, in ``step.py``."""
    tree = modules(root)
    graph = {name: imports(name, tree) for name in tree}
    ring = sorted(n for n in tree if n == f"{PACKAGE}.ring" or n.startswith(f"{PACKAGE}.ring."))
    problems = []
    for name in ring:
        reached, todo = set(), [name]
        while todo:  # everything the ring module imports, transitively
            for other in graph[todo.pop()] - reached:
                reached.add(other)
                todo.append(other)
        problems += [f"{name} imports {other}" for other in sorted(reached)
                     if other == TRAINING[0] or other.startswith(TRAINING[1:]) or other in TRAINING]
        path = tree[name][0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                     else node.name if isinstance(node, (ast.alias, ast.FunctionDef)) else None)
            if named == ADVANCING:
                problems.append(f"{name} names {ADVANCING} (line {node.lineno if hasattr(node, 'lineno') else '?'})")
            if (isinstance(node, ast.Import) and any(a.name == STEP for a in node.names)) or \
                    (isinstance(node, ast.ImportFrom) and any(a.name == "step" for a in node.names)):
                problems.append(f"{name} imports the whole {STEP} module (take current_step only)")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] == "step" and \
                    any(a.name != "current_step" for a in node.names):
                problems.append(f"{name} imports {[a.name for a in node.names]} from {STEP} (current_step only)")
    defined = sorted(str(path.relative_to(root)) for path, _ in tree.values()
                     for node in ast.walk(ast.parse(path.read_text(), str(path)))
                     if isinstance(node, ast.FunctionDef) and node.name == ADVANCING)
    if defined != [f"{PACKAGE}/step.py"]:
        problems.append(f"{ADVANCING} is defined in {defined}, not once in {PACKAGE}/step.py")
    return problems


def test_the_ring_knows_nothing_of_training():
    assert ring_problems() == []


@pytest.mark.parametrize("planted, expected", [
    ("from ..train import main", "ds_mtraining.ring.loop imports ds_mtraining.train"),
    ("from ..training.checkpoint import save_checkpoint", "ds_mtraining.ring.loop imports ds_mtraining.training"),
    ("from .. import integration", "ds_mtraining.ring.loop imports ds_mtraining.integration"),
    ("from ..step import new_step", "ds_mtraining.ring.loop names new_step"),
    ("from .. import step", "ds_mtraining.ring.loop imports the whole ds_mtraining.step module"),
    ("from ..step import current_step, new_step", "ds_mtraining.ring.loop imports ['current_step', 'new_step']"),
])
def test_a_planted_training_import_in_the_ring_fails(tree_copy, planted, expected):
    loop = tree_copy / PACKAGE / "ring" / "loop.py"
    loop.write_text(loop.read_text() + f"\n\ndef planted():\n    {planted}\n")
    problems = ring_problems(tree_copy)
    assert any(p.startswith(expected) for p in problems), problems


def test_a_second_new_step_fails(tree_copy):
    window = tree_copy / PACKAGE / "window.py"
    window.write_text(window.read_text() + "\n\ndef new_step():\n    pass\n")
    assert ring_problems(tree_copy) == ["new_step is defined in ['ds_mtraining/step.py', 'ds_mtraining/window.py'], "
                                        "not once in ds_mtraining/step.py"]
