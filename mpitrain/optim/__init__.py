"""Optimizers: SGD and Adam. Only optimizers write Parameter.data."""
from mpitrain.optim.adam import Adam
from mpitrain.optim.optimizer import Optimizer
from mpitrain.optim.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam"]
