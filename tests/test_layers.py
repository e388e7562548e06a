"""Every import in the package points down its layers, and no modules import each
other in a cycle.

Reads each module's source (imports inside functions and under TYPE_CHECKING
included: a type-only arrow is still an arrow a reader has to follow) and checks:
- a module imports only from its own layer's part or from lower layers;
- the modules' import graph has no cycle, inside a part or across parts (a package's
  `__init__` counts as a module: a submodule importing its own package's `__init__`
  is a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import cellbatch

PACKAGE = Path(cellbatch.__file__).parent

# Bottom first; each part may import only from the parts of lower layers (and itself).
LAYERS: list[set[str]] = [
    {"types"},
    {"generation_config"},
    {"metrics", "text_stream", "threads", "kv_format", "machine", "speculative"},
    {"kv_pool"},
    {"cache", "scheduler", "constraint", "tool_calls", "reasoning"},
    {"model"},
    {"export"},
    {"executor"},
    {"runner"},
    {"engine"},
    {"server"},
    {"distributed"},
    {"bench"},
    {"cli"},
    {""},  # the package's own __init__: the public API
]
LAYER_OF = {part: index for index, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = ["cellbatch", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The cellbatch modules `name` imports (a `from pkg import sub` names `pkg.sub`)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in known else target)
    return {target for target in found if target in known and target != name}


def part(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_part_of_the_package_has_a_layer() -> None:
    assert {part(name) for name in modules()} == set(LAYER_OF)


def test_imports_point_down_the_layers() -> None:
    upward = [
        f"{name} -> {target}"
        for name, targets in graph().items()
        for target in targets
        if part(target) != part(name) and LAYER_OF[part(target)] >= LAYER_OF[part(name)]
    ]
    assert not upward, "imports that point up or sideways across parts:\n" + "\n".join(upward)


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph, as the modules along it, or []."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str]:
        path.append(node)
        on_path.add(node)
        for target in sorted(edges[node]):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done and (cycle := visit(target)):
                return cycle
        on_path.discard(path.pop())
        done.add(node)
        return []

    for node in sorted(edges):
        if node not in done and (cycle := visit(node)):
            return cycle
    return []


def test_no_modules_import_each_other_in_a_cycle() -> None:
    cycle = find_cycle(graph())
    assert not cycle, "an import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
