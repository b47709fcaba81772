"""kernel-scan-fake-dict: vLLM's kernel-override scan with llvmlite (numba) loaded."""

import sys
import types

import pytest

pytest.importorskip("llvmlite.binding.ffi")


def _holder(name: str):
    kernel = lambda: None  # noqa: E731  (a stand-in kernel)
    mod = types.ModuleType(name)
    mod.kernel_copy = kernel
    sys.modules[name] = mod
    return mod, kernel


def test_the_scan_rebinds_past_llvmlites_handle_and_leaves_vars_alone():
    from vllm.triton_utils import dispatcher

    from vllm_dspark.patch import triton_utils_dispatcher as fix

    patch = fix.PATCH
    was_applied = patch.applied
    if was_applied:
        patch.restore()
    mod, kernel = _holder("dspark_test_kernel_holder")
    try:
        with pytest.raises(AttributeError, match="_lib_fn_wrapper"):  # upstream, as found
            dispatcher._rebind_kernels([(kernel, "wrapper")])
        patch.apply()
        dispatcher._rebind_kernels([(kernel, "wrapper")])
        assert mod.kernel_copy == "wrapper"
        assert "vars" not in vars(dispatcher)  # the shadow lasts only for the scan
    finally:
        del sys.modules["dspark_test_kernel_holder"]
        if patch.applied and not was_applied:
            patch.restore()
        elif was_applied and not patch.applied:
            patch.apply()


def test_instance_dict_is_empty_for_a_fake_dict():
    import llvmlite.binding.ffi as ffi

    from vllm_dspark.patch.triton_utils_dispatcher import instance_dict

    assert instance_dict(ffi.lib) == {}
    ns = types.SimpleNamespace(kernel=1)
    assert instance_dict(ns) == {"kernel": 1}


def test_the_scan_does_not_warn_about_torch_reduce_op():
    import warnings

    import torch.distributed  # noqa: F401  (its deprecated reduce_op is among the scanned names)
    from vllm.triton_utils import dispatcher

    from vllm_dspark.patch import triton_utils_dispatcher as fix

    patch = fix.PATCH
    was_applied = patch.applied
    if not was_applied:
        patch.apply()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dispatcher._rebind_kernels([])
        assert not [w for w in caught if "reduce_op" in str(w.message)], [str(w.message) for w in caught]
    finally:
        if not was_applied:
            patch.restore()
