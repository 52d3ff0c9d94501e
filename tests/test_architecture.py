"""The import graph: no cycle among mtp's modules (function-level imports included) nor among its folders, the
reference model imports nothing above it, the benchmarks stay outside the library core, and `import mtp` stays light (no
experiment-layer dependency). The tests mirror the package layout."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mtp"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the mtp modules it imports anywhere in its source (top level or inside functions). `from P import
    x` depends on P and, when P.x is a module, on P.x. Parents a dotted import implies are not counted: they
    are packages whose __init__ only re-exports."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_find_cycles_sees_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_lazy_and_relative_imports():
    g = import_graph()
    assert "mtp.model.fp8" in g["mtp.model.layers"]  # `from . import fp8`
    assert "mtp.decode.graphs" in g["mtp.decode.engine"]  # imported inside Engine.__init__


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among mtp modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def folder_of(module: str) -> str:
    """mtp.<folder> for a module inside a subpackage, the module itself for a top-level one (mtp.preflight)."""
    return ".".join(module.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the folders its modules import. The package root `mtp` is left out: its `__init__` is the lazy
    facade (`mtp.generate`, ...) that sits above every folder, and `from .. import stats` names it only as the
    parent of the module it imports."""
    out: dict[str, set[str]] = {folder_of(m): set() for m in graph if m != "mtp"}
    for m, deps in graph.items():
        if m == "mtp":
            continue
        out[folder_of(m)].update(folder_of(d) for d in deps if d != "mtp" and folder_of(d) != folder_of(m))
    return out


def test_folder_graph_sees_folder_edges():
    g = folder_graph(import_graph())
    assert "mtp.parallel" in g["mtp.backends"]  # fast_path's tensor-parallel MLP
    assert "mtp.model" in g["mtp.kernels"] and "mtp" not in g["mtp.decode"]
    assert folder_graph({"mtp.a.x": {"mtp.b.y", "mtp.a.z"}, "mtp.a.z": set(), "mtp.b.y": set()}) == \
        {"mtp.a": {"mtp.b"}, "mtp.b": set()}


def test_no_import_cycle_among_folders():
    """Dependencies point one way between folders too (style principle 12): model <- kernels <- parallel <-
    backends <- spec <- draft / verify <- decode <- distributed <- applications."""
    g = folder_graph(import_graph())
    cycles = find_cycles(g)
    graph = import_graph()
    where = {c: sorted(f"{m} -> {d}" for m, ds in graph.items() for d in ds
                       if folder_of(m) in c and folder_of(d) in c and folder_of(m) != folder_of(d))
             for c in map(tuple, cycles)}
    assert not cycles, "import cycles among mtp's folders:\n" + "\n".join(
        f"{' <-> '.join(c)}: {', '.join(w)}" for c, w in where.items())


def test_reference_model_imports_nothing_above_it():
    g = import_graph()
    bad = {m: sorted(d for d in deps if not d.startswith("mtp.model"))
           for m, deps in g.items() if m.startswith("mtp.model")}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"the reference model imports outside mtp.model: {bad}"


def test_benchmarks_stay_outside_the_library_core():
    g = import_graph()
    bad = {m: sorted(d for d in deps if d.startswith("mtp.bench"))
           for m, deps in g.items() if not m.startswith("mtp.bench")}
    bad = {m: d for m, d in bad.items() if d}
    assert not bad, f"library modules import the benchmarks (mtp.bench): {bad}"


# top-level test files that test the project as a whole rather than one module
WHOLE_PROJECT_TESTS = {"test_architecture.py", "test_packaging.py", "test_readme.py",
                       "test_interp_server.py"}  # the last: the test harness's own server (tests/interp_server.py)


def test_tests_mirror_the_layout():
    """tests/<pkg>/test_*.py for mtp/<pkg>/ (eval/ for the experiment layer), tests/test_<m>.py for a top-level
    module mtp/<m>.py; every package of mtp has its test folder."""
    tests = ROOT / "tests"
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    top_modules = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    misplaced = []
    for path in tests.rglob("test_*.py"):
        rel = path.relative_to(tests)
        if len(rel.parts) == 1:
            ok = rel.name in WHOLE_PROJECT_TESTS or rel.stem.removeprefix("test_") in top_modules
        else:
            ok = len(rel.parts) == 2 and rel.parts[0] in packages | {"eval"}
        if not ok:
            misplaced.append(str(rel))
    assert not misplaced, f"test files that do not mirror mtp/ or eval/: {misplaced}"
    untested = sorted(p for p in packages if not list((tests / p).glob("test_*.py")))
    assert not untested, f"packages of mtp without a tests/<package>/ folder of tests: {untested}"
    no_init = sorted(str(d.relative_to(ROOT)) for d in tests.iterdir() if d.is_dir() and d.name != "__pycache__"
                     and not (d / "__init__.py").exists())
    assert not no_init, f"test folders must be packages (same file names in two folders): {no_init}"


def test_import_mtp_is_light():
    heavy = ("hydra", "omegaconf", "wandb", "matplotlib", "datasets", "triton")
    code = f"import sys, mtp; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"`import mtp` loaded {r.stdout.strip()}"
