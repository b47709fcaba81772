"""The CPU flags that pick the dtype: native bf16 or not, and the warning for emulated bf16."""

from __future__ import annotations

from vllm_dspark.serving import cpu_flags
from vllm_dspark.tools import cpu_setup


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nmodel name : AMD EPYC\nflags : fpu avx2 avx512f avx512_bf16\n"
                    "processor : 1\nmodel name : AMD EPYC\nflags : fpu avx2 avx512f avx512_bf16\n")
    assert cpu_flags.read(str(info)) == ("AMD EPYC", ["avx2", "avx512f", "avx512_bf16"])
    assert cpu_flags.read(str(tmp_path / "missing")) == ("unknown", [])
    assert cpu_flags.has_native_bf16(["avx2", "amx_bf16"]) and not cpu_flags.has_native_bf16(["avx2", "avx512f"])
    # The records' machine line says the same as the dtype choice.
    assert cpu_setup.describe()["native_bf16"] == cpu_flags.has_native_bf16()


def test_the_native_dtype_is_bf16_only_where_the_cpu_has_it():
    assert cpu_flags.native_dtype(True) == "bfloat16" and cpu_flags.native_dtype(False) == "float32"
    assert cpu_flags.native_dtype() == ("bfloat16" if cpu_flags.has_native_bf16() else "float32")


def test_speculation_in_emulated_bf16_is_warned_about_and_names_the_fix():
    note = cpu_flags.emulated_bf16_note("torch.bfloat16", speculative=True, native_bf16=False)
    assert note is not None and "avx512_bf16" in note and "--dtype float32" in note
    # Native bf16, float32, or no speculation: nothing to say.
    assert cpu_flags.emulated_bf16_note("torch.bfloat16", speculative=True, native_bf16=True) is None
    assert cpu_flags.emulated_bf16_note("torch.float32", speculative=True, native_bf16=False) is None
    assert cpu_flags.emulated_bf16_note("torch.bfloat16", speculative=False, native_bf16=False) is None
    # Without a given answer the machine's own flags decide.
    assert (cpu_flags.emulated_bf16_note("bfloat16", speculative=True) is None) == cpu_flags.has_native_bf16()
