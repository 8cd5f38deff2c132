"""The import layers of ``src/shoal``, read from the modules' own imports.

``LAYERS`` declares, for a package, its rooms (subpackages and modules) in layers, highest
first. A module may import a room of a lower layer, never one of a higher layer, and never
another room of its own layer (roles such as ``router`` and ``worker`` never import each
other). An import between two modules is judged by the table of the deepest package that
holds both and has a table: ``shoal.router.routes.inference`` importing
``shoal.router.dispatch.job`` by ``shoal.router``'s (``routes`` over ``dispatch``),
importing ``shoal.protocol.ids`` by ``shoal``'s (``router`` over ``protocol``). A package's
own ``__init__`` is its lowest room. Every import counts: at module level, under
``TYPE_CHECKING``, inside functions. And no modules import each other in a circle.

A new room goes into its table at the layer it belongs to; an import the table forbids is
fixed in the code (move what both need to the lower room, or pass it in), not allowlisted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

Layers = Sequence[Sequence[str]]

LAYERS: Mapping[str, Layers] = {
    "shoal": (
        ("__main__",),
        ("cli",),
        ("up",),  # `shoal up`: a router and workers in one command
        ("router", "worker"),  # the roles
        ("data",),  # the model store, its own role and embedded by the router (--storage)
        ("models",),
        ("llama_cpp",),
        ("hardware", "keys", "tunnel", "redis_queue"),
        ("jobs",),
        ("serving",),  # every server's uvicorn, over the settings they share
        ("protocol", "settings", "pip_download", "security", "lifecycle"),
        ("tls_listener", "paths", "progress"),
        ("api_errors", "units"),
        ("__init__",),
    ),
    "shoal.router": (
        ("app",),  # the composition root
        ("routes",),
        ("admission", "async_jobs", "deployments", "responses"),
        ("dispatch",),
        ("observe",),
        ("settings", "errors"),
        ("__init__",),
    ),
    "shoal.worker": (
        ("main", "service"),  # the composition root; installing it as a system service
        ("serving",),  # what the worker serves, told to every link
        ("link", "shards"),  # how jobs reach it; its parts in split models
        ("text", "images"),  # the models it serves
        ("jobs",),  # the running jobs and where their output goes
        ("settings", "hardware", "lifecycle", "backoff", "tls", "tasks"),
        ("__init__",),
    ),
}


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module."""
    target: str
    """The project module it imports (a name imported from a package resolves to the
    package's module when there is one, else to the package)."""
    path: Path
    line: int

    def where(self, src: Path) -> str:
        return f"{self.path.relative_to(src.parent)}:{self.line}"


def modules(src: Path) -> dict[str, Path]:
    """Every module under ``src`` by its dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(src: Path, root: str) -> Iterator[Import]:
    """Every import of a module under package ``root`` by a module under ``src``."""
    known = modules(src)
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _names(node, package):
                target = _resolve(name, known)
                if target is not None and target != module and _under(target, root):
                    yield Import(module, target, path, node.lineno)


def _names(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            head = ".".join(parts[: len(parts) - node.level + 1])
            base = f"{head}.{base}" if base else head
        for alias in node.names:
            yield f"{base}.{alias.name}"  # a module, or a name whose module is ``base``


def _resolve(name: str, known: Mapping[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _room(module: str, package: str) -> str:
    rest = module[len(package) + 1 :] if module != package else ""
    return rest.partition(".")[0] or "__init__"


def _judge(imp: Import, layers: Mapping[str, Layers]) -> tuple[str, Layers, str, str] | None:
    """The deepest table whose package holds both modules in different rooms."""
    for package in sorted(layers, key=len, reverse=True):
        if _under(imp.module, package) and _under(imp.target, package):
            low, high = _room(imp.module, package), _room(imp.target, package)
            if low == high:
                continue  # the same room: a deeper table (if any) judges, else it is free
            return package, layers[package], low, high
    return None


def _rank(layers: Layers, room: str) -> int | None:
    return next((i for i, layer in enumerate(layers) if room in layer), None)


def violations(src: Path, layers: Mapping[str, Layers], root: str = "shoal") -> list[str]:
    """Each import that goes up a table, or across one layer, or into a room no table lists."""
    found: list[str] = []
    for imp in imports(src, root):
        judged = _judge(imp, layers)
        if judged is None:
            continue
        package, table, room, target_room = judged
        mine, theirs = _rank(table, room), _rank(table, target_room)
        at = f"{imp.where(src)}: {imp.module} imports {imp.target}"
        for missing, rank in ((room, mine), (target_room, theirs)):
            if rank is None:
                found.append(f"{at}: room {missing!r} is not in LAYERS[{package!r}]; add it")
        if mine is None or theirs is None:
            continue
        if theirs < mine:
            found.append(
                f"{at}: {package} room {room!r} (layer {mine}) imports {target_room!r} "
                f"(layer {theirs}, higher); move what both need down, or pass it in"
            )
        elif theirs == mine:
            found.append(
                f"{at}: {package} rooms {room!r} and {target_room!r} share layer {mine} and "
                "never import each other"
            )
    return found


def cycles(src: Path, root: str = "shoal") -> list[list[str]]:
    """The modules that import each other in a circle: each strongly connected component of
    more than one module, with the imports that close it."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports(src, root):
        edges.setdefault(imp.module, {}).setdefault(imp.target, imp)
    return [
        sorted(
            f"{imp.where(src)}: {a} imports {b}"
            for a in members
            for b, imp in edges.get(a, {}).items()
            if b in members
        )
        for members in _components(sorted(modules(src)), edges)
        if len(members) > 1
    ]


def _components(nodes: Sequence[str], edges: Mapping[str, Mapping[str, object]]) -> list[set[str]]:
    """Tarjan's strongly connected components."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            cut = stack.index(v)
            found.append(set(stack[cut:]))
            del stack[cut:]

    for node in nodes:
        if node not in index:
            visit(node)
    return found


# ---------------------------------------------------------------- the real tree


def test_no_import_goes_up_or_across_a_layer() -> None:
    found = violations(SRC, LAYERS)
    assert not found, "\n".join(found)


def test_no_modules_import_each_other_in_a_circle() -> None:
    found = cycles(SRC)
    assert not found, "\n\n".join("\n".join(c) for c in found)


def test_every_room_of_a_table_is_listed() -> None:
    """A room added to a package with a table must be placed in it, even before it imports
    anything (an unlisted room that nothing imports would otherwise go unjudged)."""
    for package, table in LAYERS.items():
        listed = {room for layer in table for room in layer}
        path = SRC.joinpath(*package.split("."))
        rooms = {p.stem for p in path.glob("*.py")} | {
            p.parent.name for p in path.glob("*/__init__.py")
        }
        assert rooms <= listed, f"{package}: {sorted(rooms - listed)} not in LAYERS"


# ---------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    src = tmp_path / "src"
    for name, text in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


_TOY: Mapping[str, Layers] = {
    "toy": (("app",), ("role_a", "role_b"), ("base",), ("__init__",)),
}
_CLEAN = {
    "toy/__init__.py": "",
    "toy/app.py": "from toy.role_a import run\nfrom toy import role_b\n",
    "toy/role_a/__init__.py": "",
    "toy/role_a/run.py": "from toy.base import thing\nfrom toy.role_a import helper\n",
    "toy/role_a/helper.py": "import toy.base\n",
    "toy/role_b.py": "from toy.base import thing\n",
    "toy/base.py": "thing = 1\n",
}


def test_the_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    src = _tree(tmp_path, _CLEAN)
    assert violations(src, _TOY, "toy") == []
    assert cycles(src, "toy") == []


def test_the_checker_catches_an_upward_import_even_inside_a_function(tmp_path: Path) -> None:
    src = _tree(
        tmp_path, {**_CLEAN, "toy/base.py": "thing = 1\n\ndef f():\n    from toy.app import x\n"}
    )
    found = violations(src, _TOY, "toy")
    assert len(found) == 1
    assert found[0].startswith("src/toy/base.py:4: toy.base imports toy.app")
    assert "room 'base' (layer 2) imports 'app' (layer 0, higher)" in found[0]


def test_the_checker_catches_one_role_importing_another_under_type_checking(
    tmp_path: Path,
) -> None:
    role_b = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.role_a import run\n"
    found = violations(_tree(tmp_path, {**_CLEAN, "toy/role_b.py": role_b}), _TOY, "toy")
    assert len(found) == 1
    assert "toy.role_b imports toy.role_a.run" in found[0]
    assert "share layer 1" in found[0]


def test_the_checker_catches_a_room_missing_from_the_table(tmp_path: Path) -> None:
    src = _tree(tmp_path, {**_CLEAN, "toy/extra.py": "from toy.base import thing\n"})
    found = violations(src, _TOY, "toy")
    assert found == [
        "src/toy/extra.py:1: toy.extra imports toy.base: room 'extra' is not in "
        "LAYERS['toy']; add it"
    ]


def test_the_checker_catches_a_circle_inside_one_room(tmp_path: Path) -> None:
    helper = "import toy.base\nfrom . import run\n"  # relative: toy.role_a.run
    src = _tree(tmp_path, {**_CLEAN, "toy/role_a/helper.py": helper})
    assert violations(src, _TOY, "toy") == []  # one room: the layers allow it
    assert cycles(src, "toy") == [
        [
            "src/toy/role_a/helper.py:2: toy.role_a.helper imports toy.role_a.run",
            "src/toy/role_a/run.py:2: toy.role_a.run imports toy.role_a.helper",
        ]
    ]
