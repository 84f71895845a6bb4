"""mpitrain: data-parallel training over MPI with a pure-Python ring-allreduce.

The top-level ``kernels/`` folder is installed as ``mpitrain.kernels`` (``package_dir``), so no generic
top-level ``kernels`` package lands in site-packages.
"""
from setuptools import find_packages, setup

setup(
    name="mpitrain",
    version="0.1.0",
    description="Data-parallel trainer over MPI: ring-allreduce, Numba/CuPy kernels, no compiler",
    python_requires=">=3.10",
    # kernels/ and its backend packages (kernels/cpu/, kernels/cuda_*/) are mpitrain.kernels.*
    packages=find_packages(include=["mpitrain", "mpitrain.*"]) + ["mpitrain.kernels"]
    + [f"mpitrain.kernels.{p}" for p in find_packages("kernels")],
    package_dir={"mpitrain.kernels": "kernels"},
    install_requires=["numpy>=1.24", "numba>=0.58", "mpi4py>=4.0", "tqdm"],
    extras_require={
        # The MPI runtime from PyPI; leave it out to use a system MPI (MPIEXEC=...).
        "mpich": ["mpich"],
        # The benchmarks' optional modules (benchmarks/benchdeps.py): matplotlib for the PNGs.
        # "plot" is the older name of the same extra.
        "bench": ["matplotlib"],
        "plot": ["matplotlib"],
        # CuPy for the --device cuda kernels, built for the CUDA major version of the driver.
        # "cuda" is the older name of "cuda12".
        "cuda12": ["cupy-cuda12x"],
        "cuda13": ["cupy-cuda13x"],
        "cuda": ["cupy-cuda12x"],
        # PyTorch for mpitrain.torch (horovod.torch's API); pinned so that pip takes the CPU
        # wheel instead of resolving a CUDA build.
        "torch": ["torch==2.13.0"],
        # TensorFlow and Keras 3 for mpitrain.tensorflow and mpitrain.keras (horovod.tensorflow's
        # API); the CPU build, pinned to the release they are tested against.
        "tensorflow": ["tensorflow-cpu==2.21.*", "keras>=3.0"],
        # tensorboardX for --tensorboard DIR (mpitrain/train/tensorboard.py).
        "tensorboard": ["tensorboardX>=2.6"],
        "test": ["mpich", "matplotlib", "pytest", "pytest-timeout", "hypothesis",
                 "torch==2.13.0", "tensorboardX>=2.6"],
    },
    entry_points={"console_scripts": ["mpitrain=mpitrain.train.cli:main",
                                      "mpitrainrun=mpitrain.run.cli:console"]},
)
