"""No module imports from a layer above it (read from the source, every import statement counted)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vllm_dspark"

# Lowest first. A module may import its own layer and any layer below.
LAYERS: list[tuple[str, ...]] = [
    ("vllm_dspark.versions", "vllm_dspark.config", "vllm_dspark.cache", "vllm_dspark.log", "vllm_dspark._C"),
    # The package root re-exports nothing but its version: it sits at the bottom.
    ("vllm_dspark.ops",),
    ("vllm_dspark.model",),
    ("vllm_dspark.checkpoint",),
    ("vllm_dspark.serving",),
    ("vllm_dspark.spec_decode", "vllm_dspark.spec_decode.common"),
    # The two runners' sides sit on one floor; test_the_runners_never_import_each_other keeps them apart.
    ("vllm_dspark.spec_decode.v1", "vllm_dspark.spec_decode.v2"),
    ("vllm_dspark.patch",),
    ("vllm_dspark.plugin",),
    # Applications built on everything above; nothing below imports them.
    ("vllm_dspark.tools", "vllm_dspark.assets"),
]


def layer_of(module: str) -> int:
    if module == "vllm_dspark":
        return 0
    # The longest matching prefix decides (spec_decode.v1 sits above spec_decode).
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    if best is not None:
        return best
    raise AssertionError(f"{module} is in no layer; add it to tests/test_layers.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names if a.name != "*"]
    return [m for m in out if m.startswith("vllm_dspark")]


def upward(me: str, imports: list[str]) -> list[str]:
    mine = layer_of(me)
    bad = []
    for imp in imports:
        # `from vllm_dspark.x import y` may name a submodule or an attribute; the package decides.
        try:
            theirs = layer_of(imp)
        except AssertionError:
            theirs = layer_of(imp.rsplit(".", 1)[0])
        if theirs > mine:
            bad.append(f"{me} (layer {mine}) imports {imp} (layer {theirs})")
    return bad


def test_every_module_is_placed_and_imports_only_downwards():
    modules = sorted(PKG.rglob("*.py"))
    names = {module_name(p) for p in modules}
    # The walk really reached every layer (a wrong PKG path would find nothing and pass).
    for prefixes in LAYERS:
        assert any(n == p or n.startswith(p + ".") for n in names for p in prefixes if p != "vllm_dspark._C"), prefixes
    bad = [b for path in modules for b in upward(module_name(path), imports_of(path))]
    assert not bad, "imports that run up a floor:\n" + "\n".join(sorted(set(bad)))


def test_the_runners_never_import_each_other():
    sides = ("vllm_dspark.spec_decode.v1", "vllm_dspark.spec_decode.v2")
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        mine = [s for s in sides if me == s or me.startswith(s + ".")]
        if mine:
            other = sides[1 - sides.index(mine[0])]
            bad += [f"{me} imports {m}" for m in imports_of(path) if m == other or m.startswith(other + ".")]
    assert not bad, "\n".join(bad)


def test_the_check_sees_an_upward_import():
    assert upward("vllm_dspark.spec_decode.v2.model", ["vllm_dspark.patch.registry"])
    assert upward("vllm_dspark.spec_decode.common.budget", ["vllm_dspark.spec_decode.v1.proposer"])
    assert upward("vllm_dspark.serving.settings", ["vllm_dspark.spec_decode.common.budget"])
    assert not upward("vllm_dspark.patch.config_speculative", ["vllm_dspark.serving.settings"])


# ------------------------------------------------------------------ import cycles
#
# Layers leave cycles inside one layer possible; these tests forbid them, lazy (function-level)
# imports included: a lazy import hides a cycle until the day someone moves it to the top.
#
# One edge per imported module, the most specific one: `from X import Y` is an edge to X.Y when
# X.Y is a module (it reads nothing from X's __init__) and to X otherwise; `import X.Y` is an edge
# to X.Y. The packages Python initialises on the way (X's __init__) are not edges: a package's
# __init__ importing its children is then no cycle, unless a child reads a name from that __init__
# (`from X import name`), which is the case that breaks on a partly initialised package.

# Cycles present when this test was written, outside the scope of the change that added it: each a
# set of modules (a strongly connected component), named so a fix can find it. A component that
# grows, or a new one, fails; so does an entry here that no longer is a cycle (remove it).
KNOWN_CYCLES: list[frozenset[str]] = []  # none: a cycle found is a failure


def import_edges(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, anywhere in the file (see the comment above)."""
    mod = module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module or ""
            targets = [f"{parent}.{a.name}" if f"{parent}.{a.name}" in known else parent for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import vllm_dspark._C` (an extension) names no source module
                t = t.rpartition(".")[0]
            if t and t != mod:
                out.add(t)
    return out


def module_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
    known = set(paths)
    return {name: import_edges(path, known) for name, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles, one per strongly connected component of two or more modules, each as a path
    ``[a, b, ..., a]`` (a shortest one from the component's first module back to it)."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += graph.get(n, ())
        reach[start] = seen
    out, done = [], set()
    for n in sorted(graph):
        if n in done or n not in reach[n]:
            continue
        comp = {m for m in reach[n] if n in reach.get(m, ())}
        done |= comp
        # breadth-first inside the component, from n back to n
        prev: dict[str, str] = {}
        frontier = [n]
        while n not in prev:
            nxt = []
            for a in frontier:
                for b in sorted(graph[a] & comp):
                    if b not in prev:
                        prev[b] = a
                        nxt.append(b)
            frontier = nxt
        path, cur = [n], prev[n]
        while cur != n:
            path.append(cur)
            cur = prev[cur]
        out.append([n, *reversed(path[1:]), n])
    return out


def test_no_import_cycles_lazy_imports_included():
    graph = module_graph()
    assert "vllm_dspark.tools.cli" in graph and graph["vllm_dspark.tools.cli"]
    found = import_cycles(graph)
    new = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    gone = [sorted(k) for k in KNOWN_CYCLES if k not in {frozenset(c) for c in found}]
    assert not new, "import cycles:\n" + "\n".join(" -> ".join(c) for c in new)
    assert not gone, f"no longer cycles, remove them from KNOWN_CYCLES: {gone}"


def test_the_check_sees_an_import_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    # two cycles through one module make one component; the path shown is a shortest one
    assert import_cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"d"}, "d": {"a"}}) == [["a", "b", "a"]]


# Beside the package in a checkout, absent from an installed wheel.
WORKSHOP = ("benchmarks", "training", "tests")


def test_the_package_imports_nothing_from_the_workshop():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{module_name(path)} imports {n}" for n in names if n.split(".")[0] in WORKSHOP]
    assert not offenders, "\n".join(offenders)
