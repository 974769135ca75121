"""``benchmarks/`` is one package: absolute imports, no circles, suites at the top.

Read from the source (no module is imported): every import of a benchmark module, here
and in these tests, names it from ``benchmarks.``; none goes round in a circle; nothing
edits ``sys.path``; each module at the top of the package is a suite that
``python -m benchmarks.NAME`` runs; every result sits in ``results/``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(path: Path) -> list[tuple[int, int, str]]:
    """(line, relative level, dotted name) of every import in the file, nested ones too;
    ``from a import b`` gives ``a.b`` and ``a`` both, as ``b`` may be a module or a name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, 0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            out.append((node.lineno, node.level, base))
            out += [(node.lineno, node.level, f"{base}.{alias.name}") for alias in node.names]
    return out


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {
        name: {
            target
            for _, level, target in _imports(path)
            if level == 0 and target in modules and target != name
        }
        for name, path in modules.items()
    }


def test_every_import_of_a_benchmark_module_is_absolute() -> None:
    modules = _modules()
    # Names a flat, path-hacked layout would import bare: ``import report``, ``import stats``.
    bare = {name.rsplit(".", 1)[-1] for name in modules} - {"benchmarks"}
    wrong = []
    for path in [*modules.values(), *sorted(Path(__file__).parent.glob("*.py"))]:
        for line, level, target in _imports(path):
            if level > 0 or target.split(".")[0] in bare:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {'.' * level}{target}")
    assert not wrong, "import these as benchmarks.<...>, absolutely:\n" + "\n".join(wrong)


def test_no_benchmark_module_edits_sys_path() -> None:
    for path in _modules().values():
        assert "sys.path" not in path.read_text(), path


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_benchmark_modules_import_each_other_without_a_circle() -> None:
    """In-function imports count too: a circle through them is a circle all the same."""
    found = _cycle(_graph(_modules()))
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_each_module_at_the_top_is_a_suite_and_shared_code_is_in_lib() -> None:
    """``python -m benchmarks.NAME`` runs every top-level module and every sub-package
    but ``lib``; what suites share lives in ``benchmarks/lib/``, not beside them."""
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "__init__.py":
            continue
        text = path.read_text()
        assert "\ndef main(" in text and 'if __name__ == "__main__":' in text, (
            f"{path.relative_to(ROOT)} is not a suite: move shared code into benchmarks/lib/"
        )
    for folder in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        if folder.name != "lib":
            assert (folder / "__main__.py").is_file(), folder


# What every suite needs and ``benchmarks/lib/`` writes once: the tiers' session of a model
# and CPU time (lib.timing), a time's table cell and the machine's load (lib.report), the
# cuts a sweep subsamples (lib.splits), a process's peak memory (lib.tiers). A suite that
# writes its own copy drifts from the rest.
SHARED = {
    "_session": "benchmarks.lib.timing.session",
    "cpu_ms": "benchmarks.lib.timing.cpu_ms",
    "_ms": "benchmarks.lib.report.ms",
    "shrinking_cuts": "benchmarks.lib.splits.shrinking_cuts",
    "load_average": "benchmarks.lib.report.load_average",
    "_rss": "benchmarks.lib.tiers.peak_rss",
    "_peak_rss_mib": "benchmarks.lib.tiers.peak_rss",
}


def test_what_suites_share_is_written_once_in_lib() -> None:
    """No suite defines its own session maker, timer, ms formatter or cut subsampler,
    nor reads the load average itself ([Note: load average in results] in
    benchmarks/lib/report.py)."""
    wrong = []
    for name, path in _modules().items():
        if name.startswith("benchmarks.lib"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name in SHARED:
                wrong.append(f"{name}:{node.lineno}: def {node.name} (use {SHARED[node.name]})")
            if isinstance(node, ast.Attribute) and node.attr == "getloadavg":
                wrong.append(f"{name}:{node.lineno}: os.getloadavg (use lib.report.load_average)")
    assert not wrong, "\n".join(wrong)


def test_every_result_is_in_the_one_results_folder() -> None:
    """Reports, plots and data sit in ``benchmarks/results/``, none beside the code."""
    stray = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*")
        if p.is_file()
        and p.suffix in {".md", ".json", ".png", ".csv"}
        and PACKAGE / "results" not in p.parents
    ]
    assert not stray, stray


@pytest.mark.integration
@pytest.mark.parametrize("suite", ["adaptation", "comparison", "generation"])
def test_a_package_suite_names_its_command_in_its_help(suite: str) -> None:
    """A suite run as ``python -m benchmarks.SUITE`` says so in its usage, not ``__main__.py``."""
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{suite}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.startswith(f"usage: python -m benchmarks.{suite} ")
    assert "__main__" not in result.stdout
