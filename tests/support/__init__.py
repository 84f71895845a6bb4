"""Helpers shared by the test suites (import as ``from tests.support import ...``; pytest runs
from the repository root, which ``python -m pytest`` puts on sys.path). No test file imports
another test file and none edits sys.path: what two suites share lives here.

- comm.py            settings for re-initialising the comm layer (never patch module state)
- oracles.py         mpi4py/NumPy oracles and rank inputs for the collective suites
- kernel_cases.py    every kernel's cases: the device backends vs the CPU kernel (cudasim, gpu)
- fake_cupy.py       a CPU stand-in for the CuPy slice that kernels/cuda_cupy/ uses
- training_cases.py  two-step trainings: a device backend vs the CPU
- gradcheck.py       finite-difference gradient checks of layers and modules
- launch.py          the environment and paths for launching mpitrain under mpiexec (e2e)
- transformer_cases.py  the transformer kernels' cases: the device backends vs the CPU kernel
- texts.py           small generated text files for the GPT tests
- tensorboard_events.py  the scalars of a TensorBoard event file, read back
- mapped.py          whether an array is (a view of) a memory map
"""
