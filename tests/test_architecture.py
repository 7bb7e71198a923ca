"""The package's layers, read from its imports: every arrow points down, no private names.

docs/architecture.md draws these rooms. A module may import modules of its own room
and of rooms below it, never above; the import graph has no cycle; no module imports
a private name (``_name``) of another module, nor reads one through a module it
imported. Only the seam (``hybridmem._torch``) touches torch's private names.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import PACKAGE

#: The rooms, from the ground floor up. A module's room is the longest prefix here.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "hybridmem._errors",
        "hybridmem._log",
        "hybridmem._env",
        "hybridmem._files",
        "hybridmem._format",
        "hybridmem._checks",
        "hybridmem._names",
        "hybridmem._closing",
        "hybridmem._phase_names",
        "hybridmem._version",
        "hybridmem._platform",
    ),
    ("hybridmem._torch",),
    ("hybridmem._devices", "hybridmem._scope"),
    # side by side: none imports another
    ("hybridmem.observe", "hybridmem.allocator", "hybridmem.packing"),
    ("hybridmem.scopes",),  # the card's wing: the scopes a sharding manager stacks
    ("hybridmem.memory",),
    ("hybridmem.ipc",),
    ("hybridmem.engine",),
    ("hybridmem",),  # the public face
    ("hybridmem.integrations",),  # engines' own APIs (vLLM's backend): never imported by the face
    ("hybridmem.bench",),
    ("hybridmem.cli",),
)

#: A module longer than this says at its top why it is long (modules are split by job,
#: never to meet a line count, so there is no hard cap).
LONG_OK = 560


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@functools.cache  # read once: every test and every file's imports ask
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str) -> tuple[int, str]:
    """The layer index and room prefix of ``module`` (the longest prefix that matches)."""
    best: tuple[int, str] | None = None
    for level, rooms in enumerate(LAYERS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (
                best is None or len(room) > len(best[1])
            ):
                best = (level, room)
    assert best is not None, f"{module} is in no room: add it to LAYERS and docs/architecture.md"
    return best


def _imports(module: str, path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every hybridmem import."""
    tree = ast.parse(path.read_text())
    known = _modules()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("hybridmem"):
                continue
            plain: list[str] = []
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:  # `from hybridmem.ipc import bucket`: a module
                    yield sub, [], node.lineno
                else:
                    plain.append(alias.name)
            if plain:
                yield node.module, plain, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hybridmem"):
                    yield alias.name, [], node.lineno


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in _modules().items():
        graph[module] = {target for target, _, _ in _imports(module, path) if target != module}
    return graph


def test_every_module_is_in_a_room() -> None:
    for module in _modules():
        room_of(module)


def test_every_arrow_points_down() -> None:
    wrong = []
    for module, path in _modules().items():
        level, room = room_of(module)
        for target, _, line in _imports(module, path):
            if target == "hybridmem" and module != "hybridmem":
                # the face: only what is above it may use it, and nothing in the package
                wrong.append(f"{module}:{line} imports the public face; import the module")
                continue
            t_level, t_room = room_of(target)
            if t_level > level:
                wrong.append(f"{module}:{line} ({room}) imports {target} ({t_room}), a higher room")
            elif t_level == level and t_room != room and level > 0:
                wrong.append(f"{module}:{line} ({room}) imports {target} ({t_room}), a sibling")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith("hybridmem") and nxt != "hybridmem":
                if state.get(nxt) == 1:
                    cycle = [*stack[stack.index(nxt) :], nxt]
                    pytest.fail("import cycle: " + " -> ".join(cycle))
                if nxt not in state:
                    visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_no_module_takes_a_private_name_of_another() -> None:
    found = []
    modules = _modules()
    for module, path in modules.items():
        for target, names, line in _imports(module, path):
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    found.append(f"{module}:{line} takes {name} from {target}")
        tree = ast.parse(path.read_text())
        aliases = {
            (a.asname or a.name): f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("hybridmem")
            for a in n.names
            if f"{n.module}.{a.name}" in modules
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{module}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert not found, "\n".join(found)


def test_only_the_seam_touches_torch_privates() -> None:
    found = []
    for module, path in _modules().items():
        if module.startswith("hybridmem._torch"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                base = node.value
                dotted = []
                while isinstance(base, ast.Attribute):
                    dotted.append(base.attr)
                    base = base.value
                if (
                    isinstance(base, ast.Name)
                    and base.id == "torch"
                    and not node.attr.startswith("__")
                ):
                    found.append(
                        f"{module}:{node.lineno} torch.{'.'.join(reversed(dotted))}.{node.attr}"
                    )
    assert not found, "\n".join(found)


def test_long_modules_say_why_at_their_top() -> None:
    long = []
    for module, path in _modules().items():
        lines = path.read_text().splitlines()
        if len(lines) > LONG_OK:
            head = "\n".join(lines[:40])
            if "Why this module is long" not in head:
                long.append(
                    f"{module}: {len(lines)} lines and no 'Why this module is long' at its top"
                )
    assert not long, "\n".join(long)


#: What the card's wing (hybridmem/scopes/) stands on; everything else is an extra.
WING_STANDS_ON = (
    "hybridmem._",  # the ground, the seam, the base
    "hybridmem.allocator",
    "hybridmem.observe",
    "hybridmem.scopes",
)


def test_the_cards_wing_imports_no_extra() -> None:
    """The scopes, cache release, phases and the registry read in one sitting.

    Offload, weight transfer, the switch, the bench, the CLI and the integrations
    stand on the wing; it imports none of them (nor packing, which is apart).
    """
    found = []
    for module, path in _modules().items():
        if not module.startswith("hybridmem.scopes"):
            continue
        for target, _, line in _imports(module, path):
            if not target.startswith(WING_STANDS_ON):
                found.append(f"{module}:{line} imports {target}")
    assert not found, "\n".join(found)


def test_every_folder_of_the_package_is_a_regular_package() -> None:
    """A folder without ``__init__.py`` is a namespace package: tools may leave it out."""
    missing = [
        path.relative_to(PACKAGE.parent).as_posix()
        for path in sorted(PACKAGE.rglob("*"))
        if path.is_dir()
        and path.name != "__pycache__"
        and any(path.glob("*.py"))
        and not (path / "__init__.py").exists()
    ]
    assert not missing, missing
