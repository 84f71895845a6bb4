"""A backend's own convolution (the optional conv2d_forward / conv2d_backward hooks) against the
CPU's, over shapes that exercise padding, stride, 1x1 and 5x5 kernels, bias or none, ReLU or
none, an accumulated weight gradient and no input gradient."""
import numpy as np

# (N, C, H, W, OC, K, stride, pad, bias, relu)
SHAPES = [
    (2, 3, 7, 6, 4, 3, 1, 1, True, True),
    (3, 2, 8, 8, 5, 3, 2, 1, False, False),
    (2, 4, 5, 5, 3, 1, 2, 0, True, False),
    (1, 2, 9, 7, 6, 5, 1, 2, True, True),
    (2, 3, 6, 6, 4, 3, 1, 0, False, True),
]
TOL = {np.float32: dict(rtol=1e-4, atol=1e-5), np.float64: dict(rtol=1e-11, atol=1e-12)}


def check_conv(cpu, dev, shape, dtype, seed=0):
    n, c, h, w, oc, k, stride, pad, use_bias, relu = shape
    g = np.random.default_rng(seed)
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    x = g.standard_normal((n, c, h, w)).astype(dtype)
    weight = g.standard_normal((oc, c, k, k)).astype(dtype)
    bias = g.standard_normal(oc).astype(dtype) if use_bias else None
    grad_y = g.standard_normal((n, oc, oh, ow)).astype(dtype)
    prior_w = g.standard_normal(weight.shape).astype(dtype)     # accumulated onto
    prior_b = g.standard_normal(oc).astype(dtype)
    tol = TOL[dtype]
    results = {}
    for name, kern in (("cpu", cpu), ("dev", dev)):
        up = kern.to_device
        y = kern.zeros((n, oc, oh, ow), dtype)
        args = (up(x), up(weight))
        kern.conv2d_forward(*args, None if bias is None else up(bias), y, stride, pad, relu)
        outs = [kern.to_host(y)]
        for accumulate, want_x in ((False, True), (True, False)):
            grad_w = up(prior_w.copy())
            grad_b = up(prior_b.copy()) if use_bias else None
            grad_x = kern.zeros(x.shape, dtype) if want_x else None
            kern.conv2d_backward(*args, y, up(grad_y), stride, pad, relu, grad_w, accumulate,
                                 grad_b, grad_x)
            outs += [kern.to_host(grad_w)] + ([kern.to_host(grad_b)] if use_bias else []) + (
                [kern.to_host(grad_x)] if want_x else [])
        results[name] = outs
    assert len(results["cpu"]) == len(results["dev"])
    for i, (want, got) in enumerate(zip(results["cpu"], results["dev"])):
        np.testing.assert_allclose(got, want, err_msg=f"output {i} of {shape}", **tol)
