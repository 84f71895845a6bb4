"""Optimizers: SGD, Adam, AdamW and RMSprop (Parameter.data is theirs alone to write), and lr
schedules."""
from mpitrain.optim.adam import Adam
from mpitrain.optim.adamw import AdamW
from mpitrain.optim.optimizer import Optimizer, is_bias_or_norm
from mpitrain.optim.rmsprop import RMSprop
from mpitrain.optim.schedule import SCHEDULES, LRSchedule
from mpitrain.optim.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "is_bias_or_norm", "LRSchedule",
           "SCHEDULES"]
