"""The shape of the package, checked from its source: no import cycles among epirl's modules.

Function-local imports count too: a cycle hidden inside a function is still a cycle a reader has to untangle.
An edge to a module's own parent package is not counted (Python imports the parent first anyway).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folders installed as epirl subpackages (setuptools package-dir mapping).
PACKAGE_DIRS = {"epirl": ROOT / "epirl", "epirl.kernels": ROOT / "kernels", "epirl.rewards": ROOT / "rewards",
                "epirl.eval": ROOT / "eval"}


def module_files() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """epirl modules that `name` imports anywhere in its file (module level or inside functions)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and not name.startswith(target + ".") and target != name:
                out.add(target)
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    files = module_files()
    graph = {name: imported_modules(name, path, set(files)) for name, path in files.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
