"""The import graph of the package, lazy imports (inside functions) included: no cycle between modules, and no
module imports a layer above its own (docs/architecture.md, "Layout" and "Architecture", names the order).

Imports under ``if TYPE_CHECKING:`` do not run and are left out; ``from recship.x import y`` counts as an import of
the module ``recship.x.y`` when ``y`` is one, else of ``recship.x``. An import of ``recship.a.b.c`` is also one of the packages
``recship.a`` and ``recship.a.b`` (their ``__init__`` runs first), the importer's own packages aside.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
# the folders that install as recship's subpackages (pyproject.toml's package-dir), and the package's own folder
FOLDERS = {"recship": "recship", "sparse": "recship.sparse", "modules": "recship.modules", "trainer": "recship.trainer",
           "models": "recship.models", "quantize": "recship.quantize", "export": "recship.export", "serving": "recship.serving"}

# bottom to top: a module may import its own layer and those below
LAYERS = [
    ["recship", "recship.names", "recship.flags", "recship.lazy", "recship.logs", "recship.plots", "recship.fx", "recship.cpus",
     "recship.native", "recship.fbgemm", "recship.oserrors", "recship.contract"],
    ["recship.sparse"],
    ["recship.modules"],
    ["recship.trainer", "recship.metrics"],
    ["recship.models"],
    ["recship.quantize"],
    ["recship.export"],
    ["recship.serving"],
    ["recship.distributed", "recship.datasets", "recship.inference", "recship.test_utils", "recship.test_models", "recship.demo", "recship.cli", "recship.__main__"],
]


def _modules() -> Dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "__pycache__" in parts or parts[:1] == ("v1",) and folder == "serving":  # generated gRPC stubs
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    skipped: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _imports(modules: Dict[str, Path]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_nodes(tree)
        targets: Set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("recship"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("recship"))
        # importing recship.a.b.c runs recship/a/b/__init__.py first: an import of each package on the way, except the
        # importer's own packages (they ran before it)
        own = _packages_of(name)
        targets.update(p for t in list(targets) for p in _packages_of(t) if p not in own)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _packages_of(module: str) -> Set[str]:
    """The packages ``module`` is inside: recship.a.b.c -> {recship, recship.a, recship.a.b}."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _layer(module: str) -> int:
    best = None
    for index, members in enumerate(LAYERS):
        for prefix in members:
            if module == prefix or (prefix != "recship" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md's Layout)"
    return best[0]


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    """The reader sees what is there: a known downward import, a lazy one, and the layer of every module."""
    graph = _imports(_modules())
    assert "recship.sparse" in graph["recship.quantize.modules"]
    assert "recship.serving.server" in graph["recship.serving.cli"]  # inside run()
    assert {_layer(m) for m in graph} == set(range(len(LAYERS)))


def test_no_module_imports_a_layer_above_its_own():
    graph = _imports(_modules())
    upward = sorted(f"{a} ({_layer(a)}) imports {b} ({_layer(b)})" for a, targets in graph.items() for b in targets
                    if _layer(b) > _layer(a))
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles = _cycles(_imports(_modules()))
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)
