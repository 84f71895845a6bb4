"""Two training steps on the Numba CUDA backend (simulated) match the same steps on the CPU.

A tiny CNN built from every layer type (Conv2D, MaxPool2D, Flatten, Linear+ReLU, Dropout, ReLU), a
tiny ResNet (BatchNorm2d/1d, a downsampling BasicBlock, global average pooling) and the zoo MLP,
trained through mpitrain.nn + mpitrain.optim with unchanged layer code: only the kernels module
differs. Shapes are tiny because the simulator runs each GPU thread in Python.
"""
import pytest

from tests.support.training_cases import CASES, check_two_steps


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_steps_match_cpu(cpu, dev, case):
    check_two_steps(cpu, dev, *CASES[case])
