"""Layers, losses, Sequential and the model zoo: model math on arrays, no MPI inside."""
