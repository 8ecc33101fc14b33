"""The house's floors, read from the source's imports (DESIGN.md, "Layout").

`wire` is the bottom floor and imports nothing of ours; `sampler` (the
agent) and `controlplane` (the server) stand on it and never import each
other; `web` (the pages) stands on the control plane; the CLI
(`nodesampler`) is above them all. No module imports one that imports it
back, however long the way round: every import counts, a function's own
included, since it runs as surely as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = {"wire": 0, "sampler": 1, "controlplane": 1, "web": 2, "nodesampler": 3}


def modules() -> dict[str, Path]:
    out = {}
    for part in FLOORS:
        for path in (ROOT / part).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of ours: `from a import b` is a.b where that is
    a module, else a (the package's own names)."""
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        found: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        # Imports for the type checker alone never run (DESIGN: a module of keys may name any stage's types).
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for stmt in block.body for n in ast.walk(stmt)}  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
        graph[module] = {m for m in found if m in known and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor(module: str) -> tuple[str, int]:
    part = module.split(".")[0]
    return part, FLOORS[part]


def test_the_reader_finds_every_kind_of_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import b\nfrom c import d\nfrom c import e\ndef f():\n    from g import h\n")
    (tmp_path / "empty.py").write_text("")
    known = {"a": tmp_path / "a.py"} | {name: tmp_path / "empty.py" for name in ("b", "c", "c.d", "g.h")}
    assert imports(known)["a"] == {"b", "c", "c.d", "g.h"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(imports(modules())) == []


def test_every_arrow_points_down_or_across_its_own_part() -> None:
    graph = imports(modules())
    assert len(graph) > 50 and graph["wire"], "the reader found the project's modules and their imports"
    upward = []
    for module, targets in sorted(graph.items()):
        part, level = floor(module)
        for target in sorted(targets):
            their_part, their_level = floor(target)
            if their_part != part and their_level >= level:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_wire_imports_nothing_of_ours_but_itself() -> None:
    graph = imports(modules())
    assert {t for m, ts in graph.items() if m.startswith("wire") for t in ts if not t.startswith("wire")} == set()


# The control plane's stages, lowest first (DESIGN: "Layout"): a module imports its own stage's
# and lower ones', never a higher one's. Its root holds the server and the keys.
STAGES = {"listen": 0, "keys": 0, "state": 1, "export": 2, "history": 3, "samples": 4, "ingest": 5, "fleet": 5}
ROOT_MODULES = {"controlplane", "controlplane.server", "controlplane.pages_api"}


def stage(module: str) -> tuple[str, int]:
    if module in ROOT_MODULES:
        return "root", len(STAGES)
    name = module.split(".")[1]
    assert name in STAGES, f"{module}: the control plane's root holds the server and its stages alone"
    return name, STAGES[name]


def test_the_control_planes_stages_import_only_down() -> None:
    graph = imports(modules())
    upward = []
    for module, targets in sorted(graph.items()):
        if not module.startswith("controlplane"):
            continue
        name, level = stage(module)
        for target in sorted(t for t in targets if t.startswith("controlplane")):
            their_name, their_level = stage(target)
            if their_name != name and their_level >= level:
                upward.append(f"{module} -> {target}")
    assert upward == []
