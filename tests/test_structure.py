"""The package's shape: no import cycles among k3compile's modules (an import inside a function counts
as much as one at module level), no module longer than 700 lines, and dependencies one way: ops ->
kernels -> runtime, and the model knows nothing of the compiler."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "k3compile"
MAX_LINES = 700


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _imports(name: str, f: pathlib.Path, mods: dict) -> set[str]:
    """The k3compile modules `name` imports anywhere in its file (the most specific module each import
    names; its own parent packages left out: importing a module runs them anyway)."""
    def best(target: str) -> str | None:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        return target or None

    pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            found |= {best(a.name) for a in node.names if a.name.startswith("k3compile")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            if base.startswith("k3compile"):
                found |= {best(f"{base}.{a.name}") for a in node.names}
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("k3compile")):
            found.add(best(node.args[0].value))
    return {m for m in found if m and m != name and not name.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]


def test_no_module_over_700_lines():
    long = {str(f.relative_to(ROOT)): n for f in PKG.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_dependencies_point_one_way():
    """runtime imports nothing of kernels / ops / passes; kernels nothing of ops / passes / the compiler;
    the model nothing of k3compile but its own modules and config."""
    graph = _graph()

    def reach(prefix: str) -> set[str]:
        return {t for m, ts in graph.items() if m.startswith(prefix) for t in ts}

    assert not {t for t in reach("k3compile.runtime") if t.startswith(("k3compile.kernels", "k3compile.ops",
                                                                       "k3compile.passes"))}
    assert not {t for t in reach("k3compile.kernels") if t.startswith(("k3compile.ops", "k3compile.passes",
                                                                       "k3compile.patterns", "k3compile.compiler",
                                                                       "k3compile.cli"))}
    assert {t for t in reach("k3compile.model") if not t.startswith("k3compile.model")} <= {"k3compile.config"}
