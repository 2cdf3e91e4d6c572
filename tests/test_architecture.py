"""The architecture as checks: the import contracts hold, function-level imports are only
for optional or heavy dependencies and say why, and the public surface is what the docs say.

`docs/architecture.md` describes the layers these checks hold the code to.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "dlrover_core"
PLUGIN_PACKAGES = sorted(p for p in (ROOT / "plugins").glob("*/dlrover_plugin_*") if p.is_dir())

#: Top-level packages a function may import lazily, and why (the comment on the import says it too).
LAZY_OK = {
    "torch": "heavy: the master, the agents and the CLI never import it",
    "docker": "optional extra (dlrover-core[docker])",
    "requests": "comes with the docker SDK",
    "kubernetes": "heavy, loaded on demand by the k8s plugin",
    "safetensors": "pulls torch in",
    "numpy": "heavy, workers only",
    "torch_npu": "vendor package, optional",
    "py_spy": "optional tool",
    "matplotlib": "optional extra (dlrover-core[plot]); importing it takes ~1.6 s",
    "dlrover_plugin_optim_agd._agd": "defines a torch.optim.Optimizer subclass: torch is heavy",
    "dlrover_core.agent.agent": "the agent (0.3 s of imports): the package's __init__ exports it on first use, so "
                                "the shared standby starts without it",
    "dlrover_core.agent.standby": "imports torch: the shared standby imports it on its warm-up thread, taking "
                                  "requests meanwhile",
}


def _lazy_ok(module: str) -> bool:
    return any(module == key or module.startswith(key + ".") for key in LAZY_OK)


def _function_level_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, source line) of every import inside a function of ``path``."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    found += [(sub.lineno, a.name, lines[sub.lineno - 1]) for a in sub.names]
                elif isinstance(sub, ast.ImportFrom):
                    module = ("." * sub.level) + (sub.module or "")
                    found.append((sub.lineno, module, lines[sub.lineno - 1]))
    return sorted(set(found))


def _sources() -> list[Path]:
    files = sorted(CORE.rglob("*.py"))
    for package in PLUGIN_PACKAGES:
        files += sorted(package.rglob("*.py"))
    return files


def test_the_import_contracts_hold():
    """`.importlinter`: the core's layers, plugins importing only the documented API, plugins
    independent of each other, and no cycle between the core's sibling packages."""
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _import_cycles(package: str) -> list[list[str]]:
    """The import cycles between ``package``'s modules (each a strongly connected component of
    two or more), at module level, where importing ``a.b.c`` from outside ``a.b`` counts as
    importing ``a.b`` too: Python runs that package's ``__init__`` (and what it re-exports)
    first. ``if TYPE_CHECKING:`` imports never run and do not count; the root package's
    ``__init__`` does not either (every module is below it)."""
    grimp = pytest.importorskip("grimp", reason="comes with import-linter (pip install -e '.[test]')")
    graph = grimp.build_graph(package, exclude_type_checking_imports=True)
    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        imported = set(graph.find_modules_directly_imported_by(module))
        for other in list(imported):
            parts = other.split(".")
            for depth in range(2, len(parts)):
                parent = ".".join(parts[:depth])
                if parent in graph.modules and not module.startswith(parent + ".") and parent != module:
                    imported.add(parent)
        edges[module] = imported
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_round_a_cycle():
    """No cycle between any two modules of the core, also not through a package's
    ``__init__`` (the contract ``no-cycles`` sees only siblings): each import goes down."""
    assert _import_cycles("dlrover_core") == []


def test_the_cycle_check_sees_a_cycle_through_a_package_init(tmp_path, monkeypatch):
    """``a`` imports ``pkg.leaf``, which runs ``pkg/__init__``, which re-exports ``pkg.mid``,
    which imports ``a``: a cycle no sibling contract sees."""
    root = tmp_path / "cyc"
    (root / "pkg").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from cyc.pkg.leaf import X\n")
    (root / "pkg" / "__init__.py").write_text("from cyc.pkg.mid import Y\n")
    (root / "pkg" / "leaf.py").write_text("X = 1\n")
    (root / "pkg" / "mid.py").write_text("import cyc.a\nY = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _import_cycles("cyc") == [["cyc.a", "cyc.pkg", "cyc.pkg.mid"]]


def test_function_level_imports_are_only_for_optional_or_heavy_packages_and_say_why():
    problems = []
    for path in _sources():
        source_lines = path.read_text().splitlines()
        for line, module, text in _function_level_imports(path):
            where = f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
            if module.startswith(".") or not _lazy_ok(module):
                problems.append(f"{where}  (import {module} at the top of the module)")
                continue
            above = source_lines[line - 2].strip() if line >= 2 else ""
            if "#" not in text and not above.startswith("#"):
                problems.append(f"{where}  (say why it is lazy in a comment)")
    assert not problems, "\n".join(problems)


def test_the_public_surface_is_small_and_documented():
    """The user API (`dlrover_core`, `dlrover_core.train`), the backend authors' API
    (`dlrover_core.backend`) and the test kit (`dlrover_core.testing`) each list their names in
    `__all__`, and every name there exists and has a docstring or is data."""
    import importlib

    sizes = {}
    for name in ("dlrover_core", "dlrover_core.train", "dlrover_core.backend", "dlrover_core.testing",
                 "dlrover_core.protocol"):
        module = importlib.import_module(name)
        exported = module.__all__
        assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
        for attr in exported:
            obj = getattr(module, attr)
            if callable(obj) and not isinstance(obj, type(sys)):
                assert (getattr(obj, "__doc__", None) or "").strip(), f"{name}.{attr} has no docstring"
        sizes[name] = len(exported)
    assert sizes["dlrover_core"] <= 30, sizes  # what a user needs: the spec, the result, the errors, hookimpl


def test_architecture_doc_lists_every_message_and_endpoint():
    """docs/architecture.md's table names every message class and every master endpoint."""
    import enum

    from dlrover_core.protocol import messages

    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for name in messages.__all__:
        obj = getattr(messages, name)
        if isinstance(obj, type) and not issubclass(obj, enum.Enum) and name != "Endpoint":
            if f"`{name}`" not in doc:
                missing.append(name)
    for endpoint in messages.ENDPOINTS.values():
        method = "POST" if endpoint.request is not None else "GET"
        if f"{method} /v1/{endpoint.name}" not in doc:
            missing.append(f"{method} /v1/{endpoint.name}")
    for name in ("MasterStatus", "JobResult", "JobEvent", "JobSpec"):
        if f"`{name}`" not in doc:
            missing.append(name)
    assert not missing, f"docs/architecture.md does not mention: {missing}"
