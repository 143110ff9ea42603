"""The package's structure: no import cycle inside quark_onnx, a light ``import quark_onnx``.

The import graph is read from the source (every ``import`` statement, at module level or inside a
function: a lazy import still ties two modules together). The package's own ``passes`` folder is
installed as ``quark_onnx.passes`` and is part of the graph.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: package name -> its source folder (as pyproject's package-dir maps them)
SOURCES = {"quark_onnx": REPO / "quark_onnx", "quark_onnx.passes": REPO / "passes"}
#: What ``import quark_onnx`` must not load: each costs tens to hundreds of milliseconds.
HEAVY = (
    "numpy",
    "onnx",
    "onnxruntime",
    "onnxsim",
    "onnx_ir",
    "ml_dtypes",
    "onnxruntime_extensions",
)


def module_files(sources: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under each source folder."""
    found: dict[str, Path] = {}
    for package, folder in sources.items():
        for path in folder.rglob("*.py"):
            if ".venv" in path.parts:
                continue
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (explicitly; not its parent packages)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                # ``from pkg import sub`` imports the submodule when there is one
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base)
                    for a in node.names
                ]
            graph[module].update(t for t in targets if t and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
    return sorted(found)


def test_no_import_cycle_inside_quark_onnx():
    graph = import_graph(module_files(SOURCES))
    assert len(graph) > 50  # the whole package was read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_lazy_and_relative_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")  # lazy
    (pkg / "b.py").write_text("from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..a import f\n")  # relative, two levels up
    (pkg / "d.py").write_text("import pkg.a\n")  # imports into the cycle, not part of it
    graph = import_graph(module_files({"pkg": pkg}))
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_import_quark_onnx_loads_no_heavy_module():
    script = f"import sys, quark_onnx\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.strip() == ""
    # the probe can see a heavy module: the public API still reaches them on first use
    script = "import sys, quark_onnx\nquark_onnx.QuantParams\nprint('numpy' in sys.modules)\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.strip() == "True"


# ------------------------------------------------------------------------------------------------
# Size limits: a module is read whole, a function on one screen or two
# ------------------------------------------------------------------------------------------------

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120

#: Modules allowed above MAX_MODULE_LINES, and why (each one is a split still to make).
LONG_MODULES: dict[str, str] = {
    "quark_onnx/quantizer.py": "the run's stages move to a pipeline package with the layout change",
    "quark_onnx/plan.py": "the planner moves to a plan package with the layout change",
}

#: Functions allowed above MAX_FUNCTION_LINES ("path::name"), and why.
LONG_FUNCTIONS: dict[str, str] = {}


def _source_files() -> list[Path]:
    return sorted(
        p for folder in SOURCES.values() for p in folder.rglob("*.py") if ".venv" not in p.parts
    )


def long_modules(files: list[Path], root: Path = REPO) -> dict[str, int]:
    """Path (relative to ``root``) -> line count, of the files over the limit."""
    sizes = {
        p.relative_to(root).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in files
    }
    return {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}


def long_functions(files: list[Path], root: Path = REPO) -> dict[str, int]:
    """``path::name`` -> line count (``def`` line to last line), of the functions over the limit."""
    found = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{path.relative_to(root).as_posix()}::{node.name}"] = lines
    return found


def test_no_module_over_the_size_limit_unless_allowed():
    files = _source_files()
    found = long_modules(files)
    assert sorted(set(found) - set(LONG_MODULES)) == [], (
        f"modules over {MAX_MODULE_LINES} lines: split by concept (or add to LONG_MODULES, "
        "saying why)"
    )
    # an entry that no longer applies goes, so that the list stays the list of splits to make
    assert sorted(set(LONG_MODULES) - set(found)) == []


def test_no_function_over_the_size_limit_unless_allowed():
    found = long_functions(_source_files())
    assert sorted(set(found) - set(LONG_FUNCTIONS)) == [], (
        f"functions over {MAX_FUNCTION_LINES} lines: split them (or add to LONG_FUNCTIONS)"
    )
    assert sorted(set(LONG_FUNCTIONS) - set(found)) == []


def test_the_size_probes_count_what_they_claim(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def line + 120
    (tmp_path / "big.py").write_text(f"def big():\n{body}\n\n\ndef small():\n    pass\n")
    files = [tmp_path / "big.py"]
    assert long_functions(files, tmp_path) == {"big.py::big": MAX_FUNCTION_LINES + 1}
    assert long_modules(files, tmp_path) == {}
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(files, tmp_path) == {"big.py": MAX_MODULE_LINES + 1}


def test_every_subpackage_is_in_the_wheel():
    """A package directory missing from pyproject's ``packages`` installs from a checkout
    (editable) but not from a wheel: ``pip install .`` then fails at import."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        "quark_onnx." + ".".join(p.parent.relative_to(REPO / "quark_onnx").parts)
        for p in (REPO / "quark_onnx").rglob("__init__.py")
    }
    found = {name.rstrip(".") for name in found}
    assert found - listed == set()
