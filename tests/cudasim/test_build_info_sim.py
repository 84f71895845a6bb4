"""mt.cuda_built() under the CUDA simulator: the Numba backend runs, so a CUDA backend is usable."""
import mpitrain as mt


def test_cuda_built_when_the_numba_backend_runs(dev):
    x = dev.zeros((3,), "float32")                 # the backend really runs here
    assert dev.to_host(x).tolist() == [0.0, 0.0, 0.0]
    assert mt.cuda_built() is True
