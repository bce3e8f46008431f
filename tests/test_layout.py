"""The package keeps its floors: no import circle, no import from a lower floor to a higher one,
no private top-level helper module, no module over 600 lines.

Every ``import`` statement counts, including ones inside functions and ``TYPE_CHECKING`` blocks:
a lazy import is still a dependency. See the floor table in ``genjax/__init__.py``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "genjax"

FLOORS = {
    "errors": 1,
    "typing": 1,
    "testing": 1,
    "config": 2,
    "processors": 2,
    "stopping": 2,
    "cache": 2,
    "kernels": 2,  # native CPU kernels (few-row and 4-bit products) and their XLA fallbacks
    "watermarking": 2,  # the detector, beside the processor it shares its green lists with
    "models": 3,
    "decoding": 3,
    "sharding": 3,
    "io": 4,
    "streaming": 4,
    "constraints": 4,
    "checkpoints": 4,  # the public name of io.checkpoints
    "tokenizer": 4,  # the public name of io.tokenizer
    "generation": 5,
    "serving": 5,
    "cli": 6,
    "": 6,  # genjax/__init__.py, the face
}
MAX_LINES = 600


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``genjax/cache/kv.py`` -> ``genjax.cache.kv``; a package's ``__init__.py`` -> its name."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path, root: pathlib.Path, modules: set[str]) -> set[str]:
    """The modules of the package that ``path`` imports anywhere in its code."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b` imports the module a.b when there is one, else names of a.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]  # `import genjax.x.y` names genjax.x.y
            if target and target != name:
                found.add(target)
    return found


def floor_of(module: str, root_name: str) -> int:
    top = module[len(root_name) + 1 :].split(".")[0] if module != root_name else ""
    if top not in FLOORS:
        raise KeyError(
            f"{module} belongs to no floor: add {top!r} to FLOORS in tests/test_layout.py "
            "(and to the table in genjax/__init__.py)"
        )
    return FLOORS[top]


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imported_modules(path, root, set(files)) for name, path in files.items()}


def upward_imports(graph: dict[str, set[str]], root_name: str) -> list[str]:
    return sorted(
        f"{source} (floor {floor_of(source, root_name)}) imports {target} "
        f"(floor {floor_of(target, root_name)})"
        for source, targets in graph.items()
        for target in targets
        if floor_of(target, root_name) > floor_of(source, root_name)
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert circles(import_graph(PACKAGE)) == []


def test_no_import_from_a_lower_floor_to_a_higher_one():
    assert upward_imports(import_graph(PACKAGE), PACKAGE.name) == []


def test_no_private_top_level_helper_modules():
    private = [p.name for p in PACKAGE.glob("_*.py") if p.name != "__init__.py"]
    assert private == [], "a helper module lives inside the package it serves"


def test_no_module_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def _write_package(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    package = root / "genjax"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


@pytest.mark.parametrize(
    "source, target",
    [
        ("from genjax.generation import entry\n", "genjax.generation.entry"),
        ("def f():\n    from genjax.generation.entry import run\n", "genjax.generation.entry"),
        ("import genjax.generation.entry\n", "genjax.generation.entry"),
        ("from genjax import generation\n", "genjax.generation"),
    ],
)
def test_the_checks_catch_an_upward_import(tmp_path, source, target):
    package = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "cache/__init__.py": "",
            "cache/kv.py": source,
            "generation/__init__.py": "",
            "generation/entry.py": "from genjax.cache import kv\n",
        },
    )
    graph = import_graph(package)
    assert graph["genjax.cache.kv"] == {target}
    assert upward_imports(graph, "genjax") == [
        f"genjax.cache.kv (floor 2) imports {target} (floor 5)"
    ]
    expected_circles = [["genjax.cache.kv", target]] if target.endswith("entry") else []
    assert circles(graph) == expected_circles


def test_the_checks_catch_a_circle_within_a_floor(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "processors/__init__.py": "",
            "processors/base.py": "from genjax.processors import warpers\n",
            "processors/warpers.py": "from genjax.processors.base import NEG_INF\n",
        },
    )
    graph = import_graph(package)
    assert upward_imports(graph, "genjax") == []
    assert circles(graph) == [["genjax.processors.base", "genjax.processors.warpers"]]
