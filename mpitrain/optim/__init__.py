"""Optimizers: SGD and Adam. Only optimizers write Parameter.data."""
