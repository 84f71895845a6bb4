"""The kernel contract as code: every name a backend module must define, with its parameters.

kernels/__init__.py's docstring says what each kernel does; this table is what a test checks
against all three backends (tests/unit/test_kernel_contract.py for the CPU, tests/cudasim for the
Numba CUDA and the CuPy backends), so the list and the modules cannot drift apart.
"""
KERNELS = {
    # memory
    "empty": ("shape", "dtype"),
    "zeros": ("shape", "dtype"),
    "to_device": ("host",),
    "to_host": ("a",),
    "synchronize": (),
    "fill": ("a", "value"),
    "copy": ("dst", "src"),
    "scale": ("a", "factor"),
    "add": ("dst", "src"),
    "cast": ("dst", "src"),
    "total": ("a",),
    # GEMM and dense layers
    "gemm": ("a", "b", "out", "trans_a", "trans_b", "accumulate"),
    "bias_act": ("y", "bias", "relu"),
    "relu": ("x", "out"),
    "relu_backward": ("y", "grad_out", "grad_in"),
    "bias_grad": ("grad_out", "grad_bias"),
    # activations
    "tanh": ("x", "out"),
    "tanh_backward": ("y", "grad_out", "grad_in"),
    "sigmoid": ("x", "out"),
    "sigmoid_backward": ("y", "grad_out", "grad_in"),
    "leaky_relu": ("x", "out", "negative_slope"),
    "leaky_relu_backward": ("x", "grad_out", "grad_in", "negative_slope"),
    "softmax": ("x", "y"),
    "softmax_backward": ("y", "grad_out", "grad_in"),
    # loss
    "softmax_xent": ("logits", "labels", "grad", "losses"),
    "count_correct": ("logits", "labels"),
    "label_smoothing": ("logits", "labels", "grad", "losses", "smoothing"),
    "mse": ("x", "target", "grad", "losses"),
    "bce_logits": ("x", "target", "grad", "losses"),
    # convolution
    "im2col": ("x", "cols", "kh", "kw", "stride", "pad"),
    "col2im": ("cols", "dx", "kh", "kw", "stride", "pad"),
    "nhwc_to_nchw": ("src", "dst"),
    "nchw_to_nhwc": ("src", "dst"),
    # pooling and dropout
    "maxpool_forward": ("x", "y", "argmax", "k", "stride"),
    "maxpool_backward": ("grad_y", "argmax", "grad_x"),
    "avgpool_forward": ("x", "y", "k", "stride"),
    "avgpool_backward": ("grad_y", "grad_x", "k", "stride"),
    "dropout_forward": ("x", "y", "mask", "p", "seed"),
    "dropout_backward": ("grad_y", "mask", "grad_x"),
    # normalisation, pooling and shortcuts
    "bn_stats": ("x", "stats"),
    "bn_moments": ("stats", "count", "eps", "momentum", "mean", "invstd", "running_mean",
                   "running_var"),
    "bn_eval_moments": ("running_mean", "running_var", "eps", "mean", "invstd"),
    "bn_forward": ("x", "mean", "invstd", "weight", "bias", "y"),
    "bn_backward_stats": ("grad_y", "x", "mean", "invstd", "stats"),
    "bn_param_grads": ("stats", "grad_weight", "grad_bias", "accumulate"),
    "bn_backward_input": ("grad_y", "x", "mean", "invstd", "weight", "stats", "count", "grad_x"),
    "global_avgpool_forward": ("x", "y"),
    "global_avgpool_backward": ("grad_y", "grad_x"),
    "shortcut_forward": ("x", "y", "stride", "offset"),
    "shortcut_backward": ("grad_y", "grad_x", "stride", "offset"),
    # optimizer updates
    "sgd_update": ("param", "grad", "buf", "lr", "momentum", "nesterov", "weight_decay"),
    "adam_update": ("param", "grad", "m", "v", "lr", "beta1", "beta2", "eps", "weight_decay",
                    "step"),
    "rmsprop_update": ("param", "grad", "square_avg", "grad_avg", "buf", "lr", "alpha", "eps",
                       "weight_decay", "momentum", "centered"),
    # transformer layers (nn/transformer.py)
    "embedding_forward": ("ids", "weight", "out"),
    "embedding_backward": ("ids", "grad_out", "grad_weight"),
    "layernorm_forward": ("x", "weight", "bias", "y", "mean", "rstd", "eps"),
    "layernorm_backward": ("grad_y", "x", "mean", "rstd", "weight", "grad_x", "grad_weight",
                           "grad_bias", "accumulate"),
    "gelu": ("x", "out"),
    "gelu_backward": ("x", "grad_out", "grad_in"),
    "to_heads": ("x", "out"),
    "from_heads": ("x", "out"),
    "batched_gemm": ("a", "b", "out", "trans_a", "trans_b", "accumulate"),
    "causal_softmax": ("scores", "probs", "scale"),
    "causal_softmax_backward": ("probs", "grad_probs", "grad_scores", "scale"),
    "adamw_update": ("param", "grad", "m", "v", "lr", "beta1", "beta2", "eps", "weight_decay",
                     "step"),
    # collective reductions
    "reduce_into": ("dst", "src", "op"),
}
# Kernels a backend may add (kernels/__init__.py): Conv2D and SGD use them where they exist.
OPTIONAL = ("conv2d_forward", "conv2d_backward", "sgd_update_group")


def collect(*modules):
    """A backend package's namespace: every kernel of the contract and every optional one, from
    the one of ``modules`` that defines it (an object imported into two of them counts once)."""
    found = {}
    for module in modules:
        for kernel in (*KERNELS, *OPTIONAL):
            fn = vars(module).get(kernel)
            if fn is not None and found.setdefault(kernel, fn) is not fn:
                raise ImportError(f"{module.__name__} defines {kernel} a second time")
    return found


def violations(module):
    """What ``module`` lacks or spells differently: [] when it meets the contract."""
    import inspect
    problems = [] if isinstance(getattr(module, "name", None), str) else ["name: not a str"]
    for kernel, params in KERNELS.items():
        fn = getattr(module, kernel, None)
        if not callable(fn):
            problems.append(f"{kernel}: missing")
            continue
        got = tuple(inspect.signature(getattr(fn, "py_func", fn)).parameters)
        if got != params:
            problems.append(f"{kernel}{got}: expected {kernel}{params}")
    return problems
