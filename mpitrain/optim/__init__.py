"""Optimizers: SGD, Adam and RMSprop (Parameter.data is theirs alone to write), and lr schedules."""
from mpitrain.optim.adam import Adam
from mpitrain.optim.optimizer import Optimizer, is_bias_or_norm
from mpitrain.optim.rmsprop import RMSprop
from mpitrain.optim.schedule import SCHEDULES, LRSchedule
from mpitrain.optim.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "RMSprop", "is_bias_or_norm", "LRSchedule", "SCHEDULES"]
