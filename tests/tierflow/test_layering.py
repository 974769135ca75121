"""The import graph matches the folders: tiers depend on the core, never the reverse.

Read from the source with :mod:`ast` (every ``import``, also those inside functions), so
a lazy import cannot hide a dependency. The core is ``tierflow/``; the runtime tiers are
``device/``, ``edge/`` and ``cloud/``, which must run on a Raspberry Pi without the
offline planner, torch or onnx (``zoo/``, ``tierflow.zoo``, holds the models built with
torch, beside the demos and benchmarks that use them; no tier loads it). The CLI names its
command modules as strings (``tierflow.cli.main.COMMAND_MODULES``), so wiring commands is
no import of a tier. Inside the core, :data:`CORE_LAYERS` orders the sub-packages and
modules, and no import (not even one inside a function or under TYPE_CHECKING) may go up
that order or close a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tierflow.cli.main import COMMAND_MODULES

ROOT = Path(__file__).resolve().parents[2]

# Source folder -> the package it becomes (pyproject.toml's package-dir).
PACKAGES = {
    "tierflow": "tierflow",
    "device": "tierflow.device",
    "edge": "tierflow.edge",
    "cloud": "tierflow.cloud",
    "partitioner": "tierflow.partitioner",
    "demos": "tierflow.demos",
    "zoo": "tierflow.zoo",
}
TIERS = ("tierflow.device", "tierflow.edge", "tierflow.cloud")
ABOVE_CORE = (*TIERS, "tierflow.partitioner", "tierflow.demos", "tierflow.zoo")
# What no module a runtime tier loads may import: the offline planner, the demos, and the
# libraries only planning and training need (onnxruntime is not onnx).
NOT_AT_RUNTIME = (
    "tierflow.partitioner",
    "tierflow.demos",
    "tierflow.zoo",
    "torch",
    "onnx",
    "sklearn",
)


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT)
    parts = [PACKAGES[relative.parts[0]], *relative.parts[1:-1]]
    if relative.stem != "__init__":
        parts.append(relative.stem)
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    """Every project module (by import name) and the modules it imports."""
    graph: dict[str, set[str]] = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = _module_name(path)
            package = module if path.stem == "__init__" else module.rpartition(".")[0]
            names: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                        base = ".".join([*anchor, *([base] if base else [])])
                    names.add(base)
                    names.update(f"{base}.{alias.name}" for alias in node.names)
            graph[module] = names
    return graph


def _within(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def _in_core(module: str) -> bool:
    return module.startswith("tierflow") and not _within(module, ABOVE_CORE)


# The core's layers, lowest first: a module imports only from its own layer and the layers
# below, so the core is a one-way stack (docs/design.md, "Layout"). A root names a module
# or a package with everything in it; ``tierflow`` alone is the package's __init__.
CORE_LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "tierflow",
        "tierflow.errors",
        "tierflow.units",
        "tierflow.extras",
        "tierflow.tuning",
        "tierflow.npz",
        "tierflow.rpc",
    ),
    ("tierflow.link",),
    ("tierflow.codec", "tierflow.image_norm", "tierflow.cache"),
    ("tierflow.transport",),
    ("tierflow.onnxrt",),
    ("tierflow.state",),
    ("tierflow.plan", "tierflow.greedy"),
    ("tierflow.options",),
    ("tierflow.runtime",),
    ("tierflow.cli",),
)


def test_the_import_graph_is_read_from_the_source() -> None:
    graph = _imports()
    # Known edges, so that a parser finding nothing cannot pass the checks below.
    assert "tierflow.runtime.upstream" in graph["tierflow.edge.forwarding"]
    assert "tierflow.cache.base.FeatureCache" in graph["tierflow.runtime.tier"]
    assert "tierflow.device.client.DeviceClient" in graph["tierflow.demos.local"]
    assert "onnxruntime" in graph["tierflow.onnxrt.inference"]
    assert not _in_core("tierflow.cloud.commands") and _in_core("tierflow.rpc.tier_pb2")


def test_the_core_imports_no_tier_planner_or_demo() -> None:
    wrong = {
        module: sorted(name for name in names if _within(name, ABOVE_CORE))
        for module, names in _imports().items()
        if _in_core(module)
    }
    assert {module: names for module, names in wrong.items() if names} == {}


def _loaded_by_tiers(graph: dict[str, set[str]]) -> set[str]:
    """The project modules that importing every module of a runtime tier loads."""
    seen: set[str] = set()
    todo = [module for module in graph if _within(module, TIERS)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        # Importing a.b.c loads a and a.b first; "from a.b import c" names a.b.c, maybe a module.
        for name in (module, *graph[module]):
            parts = name.split(".")
            prefixes = (".".join(parts[:n]) for n in range(1, len(parts) + 1))
            todo += [prefix for prefix in prefixes if prefix in graph]
    return seen


def test_runtime_tiers_load_no_planner_torch_or_onnx() -> None:
    graph = _imports()
    loaded = _loaded_by_tiers(graph)
    assert "tierflow.runtime.service" in loaded and "tierflow.cache.memory" in loaded
    wrong = {
        module: sorted(name for name in graph[module] if _within(name, NOT_AT_RUNTIME))
        for module in loaded
    }
    assert {module: names for module, names in wrong.items() if names} == {}


def test_each_tier_uses_only_the_core_and_itself() -> None:
    """No tier imports another: what two tiers share (the Redis cache the edge and the
    cloud may both keep, ``tierflow.cache.redis``) is in the core."""
    wrong: dict[str, list[str]] = {}
    for module, names in _imports().items():
        for tier in TIERS:
            if _within(module, (tier,)):
                others = [n for n in names if _within(n, TIERS) and not _within(n, (tier,))]
                if others:
                    wrong[module] = sorted(others)
    assert wrong == {}


# Planner commands that train, and so hand the planner-side code a torch trainer from
# tierflow.zoo inside their handler (the ``train`` extra): ``bottleneck add``.
TRAINING_COMMANDS = ("tierflow.partitioner.bottleneck.commands",)


def test_the_planner_needs_onnx_and_never_torch() -> None:
    """Planning (``tierflow.partitioner``, the ``plan`` extra) imports no torch; models
    built with torch live in ``tierflow.zoo`` (the ``train`` extra), which it never loads,
    except the handlers of the commands that train (:data:`TRAINING_COMMANDS`)."""
    graph = _imports()
    assert "onnx" in graph["tierflow.partitioner.graph"]
    assert "torch" in graph["tierflow.zoo.models"]
    assert "tierflow.zoo.bottleneck_train" in graph[TRAINING_COMMANDS[0]]
    torch_side = ("torch", "tierflow.zoo", "tierflow.demos")
    wrong = {
        module: sorted(name for name in names if _within(name, torch_side))
        for module, names in graph.items()
        if _within(module, ("tierflow.partitioner",)) and module not in TRAINING_COMMANDS
    }
    assert {module: names for module, names in wrong.items() if names} == {}


def _core_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each core module and the core modules it imports (any import: at load, under
    TYPE_CHECKING or inside a function). ``from a.b import c`` names ``a.b.c``: the
    module if there is one, else the name ``c`` in ``a.b``."""
    edges: dict[str, set[str]] = {}
    for module, names in graph.items():
        if not _in_core(module):
            continue
        targets = {name if name in graph else name.rpartition(".")[0] for name in names}
        edges[module] = {t for t in targets if t in graph and _in_core(t) and t != module}
    return edges


def _layer(module: str) -> int:
    matches = [
        (len(root), index)
        for index, roots in enumerate(CORE_LAYERS)
        for root in roots
        if module == root or (root != "tierflow" and module.startswith(root + "."))
    ]
    assert matches, f"{module} is in no layer of CORE_LAYERS"
    return max(matches)[1]


def test_the_core_is_a_one_way_stack() -> None:
    edges = _core_edges(_imports())
    assert "tierflow.runtime.pipeline" in edges
    assert "tierflow.transport.security" in edges["tierflow.options"]
    upward = {
        module: sorted(t for t in targets if _layer(t) > _layer(module))
        for module, targets in edges.items()
    }
    assert {module: targets for module, targets in upward.items() if targets} == {}


# Programs of their own, with their own command line: the child process that exports a
# Hugging Face decoder (``python -m tierflow.zoo.hf_decoders``), not a tierflow command.
OWN_PROGRAMS = ("tierflow.zoo.hf_decoders",)
# What declares a flag or a parser: ``parser.add_argument(...)`` and its kin.
FLAG_CALLS = frozenset(
    {
        "add_argument",
        "add_argument_group",
        "add_mutually_exclusive_group",
        "add_subparsers",
        "add_parser",
        "ArgumentParser",
    }
)


def _in_cli(module: str) -> bool:
    """``tierflow.cli``, the command modules it wires (``COMMAND_MODULES``), and the
    helpers of their handlers, named ``*commands`` (``tierflow.partitioner.decoder_commands``)."""
    return (
        _within(module, ("tierflow.cli",))
        or module in COMMAND_MODULES
        or module.rpartition(".")[2].endswith("commands")
    )


def _declares_flags(path: Path) -> list[str]:
    """The calls in ``path`` that declare flags or parsers (their names, with line numbers)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in FLAG_CALLS:
                found.append(f"{name}:{node.lineno}")
    return found


def test_flags_are_declared_only_in_the_cli() -> None:
    """No module but the CLI's imports argparse or declares a flag ([Note: flags only in
    cli] in tierflow/cli/runtime_arguments.py): the core offers parsers and typed values,
    and ``tierflow.cli.runtime_arguments.runtime_options`` builds a ``RuntimeOptions``."""
    graph = _imports()
    assert (
        "argparse" in graph["tierflow.cli.serve"] and "argparse" in graph["tierflow.device.process"]
    )
    assert _in_cli("tierflow.edge.commands") and not _in_cli("tierflow.edge.forwarding")
    assert _declares_flags(ROOT / "tierflow/cli/serve.py")
    wrong: dict[str, list[str]] = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = _module_name(path)
            if _in_cli(module) or module in OWN_PROGRAMS:
                continue
            found = _declares_flags(path) + (
                ["import argparse"] if "argparse" in graph[module] else []
            )
            if found:
                wrong[module] = found
    assert wrong == {}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges.get(target, ())))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_core_has_no_import_cycles() -> None:
    """Not even through imports under TYPE_CHECKING or inside functions: each is a
    dependency all the same, and a circle makes the order of loading matter."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles(_core_edges(_imports())) == []
