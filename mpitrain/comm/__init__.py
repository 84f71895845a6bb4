"""Collectives over MPI (see ring.py for the algorithm). Public names are listed in __all__."""
__all__ = []
