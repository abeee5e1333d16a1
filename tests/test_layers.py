"""The package's layers run one way: an import (function-local ones included) never goes from a lower layer to a
higher one, no files import each other in a circle, the trainer's embedding and distributed packages take narrow
configs instead of the trainer's config/data/metrics/placement, and an import inside a function says why."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

import nestpipe

# bottom -> top; top-level packages or modules of ``nestpipe``
LAYERS = [
    ["utils"],
    ["datasets", "kernels"],
    ["clustering"],
    ["ingest", "planning"],
    ["trainer"],
    ["measure", "serving"],
    ["demo", "cli"],
    ["api"],
    ["__main__"],
]
# (importer prefix, forbidden target prefixes): parts that take narrow configs
NARROW = [
    (("trainer.embedding", "trainer.distributed"),
     ("trainer.config", "trainer.data", "trainer.metrics", "trainer.placement")),
]


def _module_name(root: Path, path: Path) -> Tuple[str, bool]:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _comment_above(lines: List[str], index: int) -> bool:
    """A comment line directly above line ``index`` or above the run of import lines it belongs to."""
    i = index - 1
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def _imports(root: Path, package: str) -> Dict[str, List[Tuple[str, int, bool, bool]]]:
    """module -> [(imported module, line, function-local, commented)] for imports of ``package`` modules."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        name, is_pkg = _module_name(root, path)
        files[name] = (path, is_pkg)
    known = set(files)
    out: Dict[str, List[Tuple[str, int, bool, bool]]] = {}
    for name, (path, is_pkg) in files.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        local_nodes: Set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        local_nodes.add(id(inner))
        found = []
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    if node.level > 1:
                        base = base[:len(base) - (node.level - 1)]
                    mod = ".".join([package, *base] + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod]
                for a in node.names:  # `from a import b`, b a submodule
                    sub = f"{mod}.{a.name}"
                    if sub.startswith(package + ".") and sub[len(package) + 1:] in known:
                        targets.append(sub)
            else:
                continue
            local = id(node) in local_nodes
            text = " ".join(lines[max(node.lineno - 2, 0):node.end_lineno])
            commented = "#" in lines[node.lineno - 1] or _comment_above(lines, node.lineno - 1)
            del text
            for t in targets:
                if t == package or t.startswith(package + "."):
                    rel = t[len(package) + 1:]
                    # the deepest known module the import names
                    while rel and rel not in known:
                        rel = rel.rsplit(".", 1)[0] if "." in rel else ""
                    if rel:
                        found.append((rel, node.lineno, local, commented))
        out[name] = found
    return out


def _layer(module: str) -> Optional[int]:
    top = module.split(".")[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return None


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one file (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(root: Path, package: str = "nestpipe") -> List[str]:
    """Every violation of the layering rules in the package at ``root``, one line each."""
    problems = []
    imports = _imports(root, package)
    graph: Dict[str, Set[str]] = {}
    for mod, found in imports.items():
        if not mod:
            continue  # the package's own __init__ (its face) may re-export
        for target, line, local, commented in found:
            where = f"{package}.{mod}:{line}"
            if target != mod and not target.startswith(mod + "."):  # a package importing its own submodules is fine
                graph.setdefault(mod, set()).add(target)
            lo, hi = _layer(mod), _layer(target)
            top_from, top_to = mod.split(".")[0], target.split(".")[0]
            if lo is None or hi is None:
                problems.append(f"{where}: {package}.{mod if lo is None else target} is in no layer")
            elif hi > lo:
                problems.append(f"{where}: imports {package}.{target} (layer {hi}) from layer {lo}: upward")
            elif hi == lo and top_from != top_to:
                problems.append(f"{where}: imports {package}.{target}: a sibling package of the same layer")
            for importers, forbidden in NARROW:
                if mod.startswith(importers) and target.startswith(forbidden):
                    problems.append(f"{where}: {package}.{mod} imports {package}.{target} (pass a narrow config)")
            if local and not commented:
                problems.append(f"{where}: function-local import of {package}.{target} without a comment saying why")
    for comp in _cycles(graph):
        problems.append("files import each other in a circle: " + " -> ".join(f"{package}.{m}" for m in comp))
    return problems


def test_the_package_layers_run_one_way():
    problems = check(Path(os.path.dirname(nestpipe.__file__)))
    assert not problems, "\n".join(problems)


# -- negative controls: the checker finds each kind of violation in a small synthetic package ---------------------
def _tree(tmp_path: Path, files: Dict[str, str]) -> Path:
    root = tmp_path / "nestpipe"
    for rel, text in {"__init__.py": "", "utils/__init__.py": "", "datasets/__init__.py": "",
                      "trainer/__init__.py": "", "trainer/config.py": "", "trainer/embedding/__init__.py": "",
                      **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_clean_tree_has_no_violations(tmp_path):
    root = _tree(tmp_path, {"utils/io.py": "import os\n", "datasets/shards.py": "from nestpipe.utils import io\n",
                            "trainer/loop.py": "from nestpipe.datasets import shards\nfrom . import config\n",
                            "trainer/embedding/store.py": "def f():\n    # start-up time\n"
                                                          "    from nestpipe.utils import io\n"})
    assert check(root) == []


@pytest.mark.parametrize("files, expected", [
    ({"utils/io.py": "from nestpipe.datasets import shards\n", "datasets/shards.py": ""}, "upward"),
    ({"utils/io.py": "def f():\n    from nestpipe.trainer import config  # why\n"}, "upward"),
    ({"datasets/a.py": "from nestpipe.datasets import b\n",
      "datasets/b.py": "def f():\n    from nestpipe.datasets import a  # lazily\n"}, "circle"),
    ({"trainer/embedding/store.py": "from nestpipe.trainer.config import X\n"}, "narrow config"),
    ({"trainer/embedding/store.py": "from ..config import X\n"}, "narrow config"),
    ({"trainer/loop.py": "def f():\n    from nestpipe.datasets import shards\n", "datasets/shards.py": ""},
     "without a comment"),
    ({"kernels/__init__.py": "from nestpipe.datasets import shards\n", "datasets/shards.py": ""}, "sibling"),
])
def test_negative_controls_each_violation_is_reported(tmp_path, files, expected):
    problems = check(_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems
