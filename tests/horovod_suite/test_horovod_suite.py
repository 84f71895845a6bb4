"""Horovod's own test_torch.py against mpitrain.torch (run.py), as one pytest test: skipped
unless HOROVOD_SOURCE names a horovod/horovod checkout; otherwise every test Horovod's file
holds, except those run.OUT_OF_SCOPE lists, must pass or skip at N = 1, 2, 3
(HOROVOD_SUITE_SIZES to choose). Run it as one process: it starts its own mpiexec jobs."""
import os

import pytest

from tests.horovod_suite import run


@pytest.mark.skipif(not os.environ.get("HOROVOD_SOURCE"),
                    reason="HOROVOD_SOURCE (a horovod/horovod checkout) is not set")
def test_horovod_suite_passes():
    sizes = os.environ.get("HOROVOD_SUITE_SIZES", "1,2,3")
    assert run.main(["--sizes", sizes]) == 0, "Horovod's suite failed (the lines above)"
