"""Whether an array reads a file's pages: the data tests' check that a rank's reads stay lazy."""
import mmap

import numpy as np


def memory_mapped(array):
    """True when ``array`` is a memmap or a view of one (walks the .base chain)."""
    while array is not None:
        if isinstance(array, (np.memmap, mmap.mmap)):
            return True
        array = getattr(array, "base", None)
    return False
