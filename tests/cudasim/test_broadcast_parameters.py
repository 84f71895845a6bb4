"""mt.broadcast_parameters on a dict of simulated Numba device arrays (which carry
``__cuda_ndarray__`` but no ``__cuda_array_interface__``): they are broadcast as arrays, not
mistaken for Parameters (which would fail on ``.data``)."""
import numpy as np

import mpitrain as mt


def test_dict_of_device_arrays_is_broadcast_in_place(dev):
    mt.init()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)                  # (2, 3)
    params = {"w": dev.to_device(x), "b": dev.to_device(np.ones(3, np.float32))}
    mt.broadcast_parameters(params, root_rank=0)
    np.testing.assert_array_equal(dev.to_host(params["w"]), x)
    np.testing.assert_array_equal(dev.to_host(params["b"]), np.ones(3, np.float32))


def test_state_dict_of_a_device_model_is_broadcast_into_the_model(dev):
    """model.state_dict() on a device backend holds the live device arrays: the Horovod idiom
    writes into the model (and Parameters, whose .data is a device array, work as well)."""
    mt.init()
    model = mt.models.mlp(in_features=6, hidden=(4,), classes=3, seed=0, kernels=dev)
    state = model.state_dict()
    assert all(state[n] is p.data for n, p in model.named_parameters())
    before = model.state_dict(copy=True)
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    mt.broadcast_parameters(model.parameters(), root_rank=0)
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(dev.to_host(p.data), before[name])
