"""The CPU KV-cache default and the one-line memory errors (``vllm_dspark.serving.memory``), no engine.

The last two tests build vLLM's config the way ``vllm serve`` and ``LLM(...)`` do
(``EngineArgs.create_engine_config``) with the node's memory faked, so they check the patch
that applies the plan (``vllm_dspark.patch.platforms_cpu``) without starting anything.
"""

from __future__ import annotations

import logging

import pytest

from vllm_dspark.serving import memory
from vllm_dspark.serving.memory import DSparkMemoryError, GiB, plan_kv_cache

NODE = dict(total=24 * GiB, available=16 * GiB)


def plan(**kw):
    args = dict(env_value=None, explicit_bytes=None, kv_bytes_after=None, utilization=0.92, **NODE)
    args.update(kw)
    return plan_kv_cache(**args)


def test_default_is_4_gib_when_there_is_room_and_says_how_to_override():
    p = plan()
    assert p.kv_bytes == 4 * GiB
    assert "4.00 GiB" in p.message and "VLLM_CPU_KVCACHE_SPACE=<GiB>" in p.message
    assert "--kv-cache-memory-bytes" in p.message and "--gpu-memory-utilization" in p.message
    assert "\n" not in p.message


def test_default_is_a_quarter_of_the_available_memory_split_over_workers():
    assert plan(available=6 * GiB).kv_bytes == int(1.5 * GiB)
    p = plan(available=8 * GiB, workers=4)
    assert p.kv_bytes == int(0.5 * GiB) and "per worker (4 workers)" in p.message


def test_a_chosen_size_is_left_alone():
    assert plan(env_value="2", kv_bytes_after=2 * GiB) == memory.KVPlan(None, None)
    assert plan(explicit_bytes=GiB, kv_bytes_after=GiB) == memory.KVPlan(None, None)
    assert plan(utilization=0.5) == memory.KVPlan(None, None)  # 12 GiB of 24 fits in 16 available
    assert plan(env_value="", kv_bytes_after=None).kv_bytes == 4 * GiB  # '' is unset, as vLLM reads it


@pytest.mark.parametrize("kw, setting, fix", [
    (dict(env_value="20", kv_bytes_after=20 * GiB), "VLLM_CPU_KVCACHE_SPACE=20", "VLLM_CPU_KVCACHE_SPACE=8"),
    (dict(explicit_bytes=20 * GiB, kv_bytes_after=20 * GiB), "--kv-cache-memory-bytes", "--kv-cache-memory-bytes 8"),
    (dict(utilization=0.8), "--gpu-memory-utilization 0.8", "--gpu-memory-utilization 0.60"),
])
def test_what_cannot_fit_fails_in_one_line_naming_the_setting_and_a_value_that_fits(kw, setting, fix):
    with pytest.raises(DSparkMemoryError) as info:
        plan(**kw)
    msg = str(info.value)
    assert setting in msg and fix in msg, msg
    assert "NUMA node 0 has 16.00 GiB available of 24.00 GiB" in msg
    assert "\n" not in msg
    assert memory.is_memory_error(info.value)


def test_a_node_with_almost_nothing_free_is_told_so():
    with pytest.raises(DSparkMemoryError, match="too little for a KV cache .* set VLLM_CPU_KVCACHE_SPACE=<GiB>"):
        plan(available=GiB // 2)


def test_vllms_own_refusal_is_recognised():
    vllm_msg = ("Available memory on node 0 (8.69/11.09 GiB) on startup is less than desired CPU memory "
                "utilization (0.92, 10.2 GiB).")
    assert memory.is_memory_error(ValueError(vllm_msg))
    assert not memory.is_memory_error(ValueError("something else"))


def _engine_config(monkeypatch, available, **engine_kw):
    """vLLM's config for a tiny target as `vllm serve` builds it, on a node with ``available`` bytes free."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_dspark.plugin

    vllm_dspark.plugin.register()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(memory, "node_memory", lambda: (0, 24 * GiB, available))
    return EngineArgs(model=str(engine_kw.pop("target")), max_model_len=256, **engine_kw).create_engine_config()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tests.tiny_pair import make_target

    return make_target(tmp_path_factory.mktemp("mem_target") / "target", vocab_size=320, num_layers=2)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_patch_sets_the_default_in_vllms_config_and_logs_it(monkeypatch, tiny_target):
    ours = logging.getLogger("vllm_dspark")
    seen = _Lines()
    ours.addHandler(seen)
    monkeypatch.setattr(ours, "level", logging.INFO)
    try:
        cfg = _engine_config(monkeypatch, 6 * GiB, target=tiny_target)
    finally:
        ours.removeHandler(seen)
    assert cfg.cache_config.kv_cache_memory_bytes == int(1.5 * GiB)
    lines = [m for m in seen.lines if "CPU KV cache" in m]
    assert len(lines) == 1 and "VLLM_CPU_KVCACHE_SPACE is unset" in lines[0], lines
    # A size the user chose wins: --kv-cache-memory-bytes is kept as given.
    cfg = _engine_config(monkeypatch, 6 * GiB, target=tiny_target, kv_cache_memory_bytes=GiB // 2)
    assert cfg.cache_config.kv_cache_memory_bytes == GiB // 2


def test_the_patch_refuses_an_impossible_share_before_any_engine_process(monkeypatch, tiny_target):
    from vllm_dspark.plugin import _dspark_error

    with pytest.raises(Exception) as info:  # pydantic may wrap it while building the config
        _engine_config(monkeypatch, 6 * GiB, target=tiny_target, gpu_memory_utilization=0.5)
    ours = _dspark_error(info.value)
    assert isinstance(ours, DSparkMemoryError), info.value
    assert "--gpu-memory-utilization 0.5" in str(ours) and "VLLM_CPU_KVCACHE_SPACE" in str(ours)


def test_the_engine_cores_rerun_of_the_hook_does_not_refuse_the_cache_it_allocated(monkeypatch, tiny_target):
    """vLLM's engine core re-runs VllmConfig.__post_init__ after allocating the KV cache, when that
    memory is no longer free: the planned size must pass (a refusal there would kill the engine)."""
    cfg = _engine_config(monkeypatch, 6 * GiB, target=tiny_target)
    monkeypatch.setattr(memory, "node_memory", lambda: (0, 24 * GiB, GiB // 4))  # the cache took the memory
    cfg.__post_init__()
    assert cfg.cache_config.kv_cache_memory_bytes == int(1.5 * GiB)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    cfg.__post_init__()
    assert cfg.cache_config.kv_cache_memory_bytes == 2 * GiB


def test_without_checking_only_the_default_is_decided():
    assert plan(env_value="20", kv_bytes_after=20 * GiB, check=False) == memory.KVPlan(None, None)
    assert plan(utilization=0.8, check=False) == memory.KVPlan(None, None)
    assert plan(check=False).kv_bytes == 4 * GiB


@pytest.mark.parametrize("native,dtype,warned", [(False, "bfloat16", True), (True, "bfloat16", False),
                                                 (False, "float32", False)])
def test_speculation_in_emulated_bf16_is_warned_about_once_while_the_config_is_built(monkeypatch, tiny_target,
                                                                                      native, dtype, warned):
    from vllm_dspark.serving import cpu_flags

    monkeypatch.setattr(cpu_flags, "has_native_bf16", lambda flags=None: native)
    ours = logging.getLogger("vllm_dspark")
    seen = _Lines()
    ours.addHandler(seen)
    monkeypatch.setattr(ours, "level", logging.INFO)
    try:
        _engine_config(monkeypatch, 6 * GiB, target=tiny_target, dtype=dtype, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    finally:
        ours.removeHandler(seen)
    lines = [m for m in seen.lines if "no native bf16" in m]
    assert len(lines) == (1 if warned else 0), seen.lines
