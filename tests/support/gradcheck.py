"""Finite-difference gradient checks (float64) shared by the layer, BatchNorm and ResNet tests.

Each check uses the scalar L = sum(forward(x) * R) for a fixed random R, so backward(R) must equal
dL/dx and dL/dparam; central differences with h = 1e-6 give about 1e-8 relative accuracy.
"""
import numpy as np

H = 1e-6
TOL = 1e-6


def numeric_grad(f, a, h=H):
    """Central differences of the scalar f() w.r.t. every element of a (perturbed in place)."""
    g = np.zeros_like(a)
    flat, gflat = a.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = f()
        flat[i] = old - h
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * h)
    return g


def assert_close(analytic, numeric, what, tol=TOL):
    scale = max(1.0, np.abs(numeric).max())
    err = np.abs(analytic - numeric).max() / scale
    assert err < tol, f"{what}: max relative error {err:.3e}"


def check_layer(layer, x, rng):
    """Input and parameter gradients of one leaf layer (``backward(r, need_input_grad=True)``)."""
    y = layer.forward(x)
    r = rng.standard_normal(y.shape)

    def loss():
        return float(np.sum(layer.forward(x) * r))

    loss()
    for p in layer.parameters():
        p.zero_grad()
    grad_x = np.array(layer.backward(r.copy(), need_input_grad=True))
    assert_close(grad_x, numeric_grad(loss, x), f"{layer!r} d/dx")
    for name, p in layer.named_parameters():
        assert_close(np.array(p.grad), numeric_grad(loss, p.data), f"{layer!r} d/d{name}")


def check_module(module, x, rng, tol=TOL):
    """The same for a composite Module, through ``forward_through``/``backward_through``."""
    y = module.forward_through(x)
    r = rng.standard_normal(y.shape)

    def loss():
        return float(np.sum(module.forward_through(x) * r))

    loss()
    module.zero_grad()
    grad_x = np.array(module.backward_through(r.copy(), True, None))
    assert_close(grad_x, numeric_grad(loss, x), f"{type(module).__name__} d/dx", tol)
    for name, p in module.named_parameters():
        assert_close(np.array(p.grad), numeric_grad(loss, p.data),
                     f"{type(module).__name__} d/d{name}", tol)
