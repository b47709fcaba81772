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
