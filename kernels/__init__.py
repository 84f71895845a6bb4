"""Kernel registry: one package per backend, the same names in each.

Layers, losses and optimizers never import NumPy/CuPy/Numba kernels directly and never branch on the
array type: they ask ``get(device, flavour)`` for a backend module and call its kernels. Backends:

    ("cpu",  "numba")  -> mpitrain.kernels.cpu          NumPy arrays, numba.njit kernels, BLAS GEMM
    ("cuda", "cupy")   -> mpitrain.kernels.cuda_cupy    CuPy arrays, CuPy kernels, cuBLAS GEMM
    ("cuda", "numba")  -> mpitrain.kernels.cuda_numba   device arrays, numba.cuda kernels for all
                                                       (runs under NUMBA_ENABLE_CUDASIM=1 too)

The contract every backend implements (names and parameters as code: contract.py, which the tests
check and each backend package's namespace follows; shape checks: checks.py; arrays are the
backend's own array type, C-contiguous, float32 or float64 unless stated; "in place" kernels
return None; outputs are preallocated by the caller so steady-state training allocates nothing):

Memory
    name                                  str, e.g. "cpu", "cuda-numba", "cuda-cupy"
    empty(shape, dtype) / zeros(shape, dtype)
    to_device(host_ndarray) -> array      copy of a NumPy array on this backend
    to_host(array) -> numpy.ndarray       copy back to the host (a view is fine on the CPU)
    synchronize()                         wait for queued device work (no-op on the CPU)
    fill(a, value)                        a[...] = value
    copy(dst, src)                        dst[...] = src (same shape)
    scale(a, factor)                      a *= factor
    add(dst, src)                         dst += src   (flat, same length)
    cast(dst, src)                        dst[...] = src with dst's dtype (fp16 compression)
    total(a) -> float                     sum of all elements, as a Python float
GEMM
    gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False)
                                          out (=|+=) op(a) @ op(b), all 2-D
Dense layers
    bias_act(y, bias, relu)               y (B, F) += bias (F,); then y = max(y, 0) if relu
    relu(x, out)                          out = max(x, 0)
    relu_backward(y, grad_out, grad_in)   grad_in = grad_out * (y > 0)   (y: the ReLU output)
    bias_grad(grad_out, grad_bias)        grad_bias (F,) += grad_out (B, F).sum(axis=0)
Activations (elementwise on flat views, any shape; y: the forward output, x: its input)
    tanh(x, out) / tanh_backward(y, grad_out, grad_in)
                                          out = tanh(x); grad_in = grad_out * (1 - y**2)
    sigmoid(x, out) / sigmoid_backward(y, grad_out, grad_in)
                                          out = 1 / (1 + exp(-x)), evaluated with exp(-|x|) only
                                          (no overflow); grad_in = grad_out * y * (1 - y)
    leaky_relu(x, out, negative_slope)    out = x if x > 0 else negative_slope * x
    leaky_relu_backward(x, grad_out, grad_in, negative_slope)
                                          grad_in = grad_out if x > 0 else negative_slope*grad_out
    softmax(x, y)                         x, y (..., K): y = exp(x - max) / sum(exp(x - max))
                                          over the last axis, row by row
    softmax_backward(y, grad_out, grad_in)
                                          grad_in = y * (grad_out - sum(grad_out * y)) per row
Loss
    softmax_xent(logits, labels, grad, losses)
                                          logits (B, K), labels (B,) int64; per-sample loss
                                          -log softmax[label] into losses (B,), stable
                                          (log-sum-exp); grad = (softmax - onehot) / B
    count_correct(logits, labels) -> int  number of rows whose argmax equals the label
    label_smoothing(logits, labels, grad, losses, smoothing)
                                          turns softmax_xent's losses and grad (in place) into
                                          those of the smoothed target q = (1 - e) * onehot + e/K
                                          (e = smoothing): losses += e * (logits[label] -
                                          mean(logits)); grad += e * (onehot - 1/K) / B
    mse(x, target, grad, losses)          any shape, n = x.size: losses = (x - target)**2
                                          elementwise; grad = 2 * (x - target) / n
    bce_logits(x, target, grad, losses)   any shape, n = x.size: losses = max(x, 0) - x*target
                                          + log1p(exp(-|x|)) (stable); grad = (sigmoid(x) -
                                          target) / n
Convolution (im2col + GEMM; rows of cols are output pixels in (n, oh, ow) order;
            device backends' shape check: kernels/checks.py)
    im2col(x, cols, kh, kw, stride, pad)  x (N, C, H, W) -> cols (N*OH*OW, C*KH*KW)
    col2im(cols, dx, kh, kw, stride, pad) overwrites dx (N, C, H, W) with the scatter-add of cols
    nhwc_to_nchw(src, dst)                src (N*OH*OW, C) -> dst (N, C, OH, OW)
    nchw_to_nhwc(src, dst)                src (N, C, OH, OW) -> dst (N*OH*OW, C)
    (optional, not in the contract: a backend may add conv2d_forward / conv2d_backward, its own
    whole convolution, which Conv2D then uses instead; the CPU (kernels/cpu/conv.py) and the
    CuPy flavour do)
Pooling and dropout
    maxpool_forward(x, y, argmax, k, stride)
                                          x (N, C, H, W) -> y (N, C, OH, OW); argmax int32 (same
                                          shape as y) holds the flat index h*W + w of the max
    maxpool_backward(grad_y, argmax, grad_x)
                                          overwrites grad_x with grad_y routed to the argmax
    avgpool_forward(x, y, k, stride)      x (N, C, H, W) -> y (N, C, OH, OW): mean of each k x k
                                          window, OH = (H - k) // stride + 1 (no padding)
    avgpool_backward(grad_y, grad_x, k, stride)
                                          overwrites grad_x with the sum over the windows that
                                          hold each pixel of grad_y / (k*k) (a gather)
    dropout_forward(x, y, mask, p, seed)  mask[i] = 1/(1-p) or 0 from a counter-based hash of
                                          (seed, i) -- identical on every backend; y = x * mask.
                                          Exactly: mix = lowbias32 on uint32 (x ^= x>>16;
                                          x *= 0x7FEB352D; x ^= x>>15; x *= 0x846CA68B;
                                          x ^= x>>16, all mod 2**32); h = mix(mix(i) ^
                                          mix(seed mod 2**32)), i the flat index; keep iff
                                          (h >> 8) >= int(p * 2**24); 0 <= p < 1
                                          (host half: kernels/dropout_hash.py)
    dropout_backward(grad_y, mask, grad_x)
                                          grad_x = grad_y * mask
Normalisation, pooling and shortcuts
    x is (N, C) or (N, C, H, W) (BatchNorm1d / BatchNorm2d); "per channel" means over axis 1,
    reducing over N and H*W. `stats` arrays are (2, C) float64 on every backend (so SyncBatchNorm
    can sum them across ranks without cancellation); all arithmetic of the bn_* kernels is float64.
    bn_stats(x, stats)                    stats[0, c] = sum of x[:, c], stats[1, c] = sum of
                                          x[:, c]**2 (overwrites)
    bn_moments(stats, count, eps, momentum, mean, invstd, running_mean, running_var)
                                          training: mean = stats[0]/count, var = max(stats[1]/count
                                          - mean**2, 0) (biased), invstd = 1/sqrt(var + eps);
                                          running_mean = (1-momentum)*running_mean + momentum*mean;
                                          running_var = (1-momentum)*running_var
                                          + momentum*var*count/(count-1) (unbiased; var itself when
                                          count == 1). mean/invstd/running_* are (C,) in x's dtype
    bn_eval_moments(running_mean, running_var, eps, mean, invstd)
                                          mean = running_mean, invstd = 1/sqrt(running_var + eps)
    bn_forward(x, mean, invstd, weight, bias, y)
                                          y = (x - mean[c]) * invstd[c] * weight[c] + bias[c]
    bn_backward_stats(grad_y, x, mean, invstd, stats)
                                          stats[0, c] = sum of grad_y[:, c]; stats[1, c] = sum of
                                          grad_y[:, c] * xhat[:, c], xhat = (x - mean) * invstd
                                          (overwrites)
    bn_param_grads(stats, grad_weight, grad_bias, accumulate)
                                          grad_weight (=|+=) stats[1]; grad_bias (=|+=) stats[0]
    bn_backward_input(grad_y, x, mean, invstd, weight, stats, count, grad_x)
                                          grad_x = weight*invstd*(grad_y - stats[0]/count
                                          - xhat*stats[1]/count) (training-mode input gradient;
                                          count = elements per channel the stats were summed over,
                                          the global count for SyncBatchNorm)
    global_avgpool_forward(x, y)          x (N, C, H, W) -> y (N, C): mean over H*W
    global_avgpool_backward(grad_y, grad_x)
                                          grad_x[n, c, :, :] = grad_y[n, c] / (H*W) (overwrites)
    shortcut_forward(x, y, stride, offset)
                                          option-A ResNet shortcut: x (N, C, H, W) -> y (N, C2, OH,
                                          OW), OH = ceil(H/stride), OW = ceil(W/stride),
                                          C2 >= C+offset: y[:, offset:offset+C] =
                                          x[:, :, ::stride, ::stride], every other channel of y
                                          zero (overwrites)
    shortcut_backward(grad_y, grad_x, stride, offset)
                                          grad_x (N, C, H, W) = zeros, then grad_x[:, :, ::s, ::s]
                                          = grad_y[:, offset:offset+C] (overwrites)
Optimizer updates (in place on param and state)
    sgd_update(param, grad, buf, lr, momentum, nesterov, weight_decay)
                                          PyTorch semantics: g = grad + wd*param;
                                          buf = momentum*buf + g (buf starts at zeros, which
                                          gives PyTorch's buf = g on step 1; buf is unused
                                          when momentum == 0);
                                          g = g + momentum*buf if nesterov else buf;
                                          param -= lr*g
    (optional, not in the contract: sgd_update_group(params, grads, bufs, lr, momentum,
    nesterov, weight_decays), sgd_update of every parameter of an optimizer in one call, which
    SGD then uses; the CuPy flavour has it)
    adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step)
                                          PyTorch Adam (L2 weight decay added to grad),
                                          bias correction with the 1-based step
    rmsprop_update(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay,
                   momentum, centered)    PyTorch RMSprop: g = grad + wd*param;
                                          square_avg = alpha*square_avg + (1-alpha)*g**2;
                                          centered: grad_avg = alpha*grad_avg + (1-alpha)*g and
                                          avg = sqrt(square_avg - grad_avg**2) + eps, else
                                          avg = sqrt(square_avg) + eps; momentum: buf =
                                          momentum*buf + g/avg, param -= lr*buf; else param -=
                                          lr*g/avg (grad_avg, buf unused, may be None, when not
                                          centered / momentum == 0)
    adamw_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step)
                                          PyTorch AdamW: param *= 1 - lr*wd (decoupled decay),
                                          then adam_update with weight_decay 0
Transformer layers (token rows: n = B*T rows of C channels; G = B*H attention groups)
    embedding_forward(ids, weight, out)   ids (n,) int32/int64, weight (V, C): out (n, C) =
                                          weight[ids] (overwrites)
    embedding_backward(ids, grad_out, grad_weight)
                                          grad_weight (V, C) += scatter-add of grad_out (n, C)
                                          by ids, deterministic: each row's additions are made
                                          in increasing n whatever the threads (no atomics)
    layernorm_forward(x, weight, bias, y, mean, rstd, eps)
                                          x, y (n, C); mean, rstd (n,) in x's dtype, saved
                                          for the backward: y = (x - mean) * rstd * weight + bias,
                                          rstd = 1/sqrt(var + eps), var the biased variance
    layernorm_backward(grad_y, x, mean, rstd, weight, grad_x, grad_weight, grad_bias,
                       accumulate)        grad_x (n, C) overwritten; grad_weight, grad_bias (C,)
                                          overwritten, or added to when accumulate; sums over
                                          rows in a fixed order
    gelu(x, out) / gelu_backward(x, grad_out, grad_in)
                                          GPT-2's tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x +
                                          0.044715 x^3))) and its exact derivative (elementwise)
    to_heads(x, out)                      x (B, T, S, H, D) -> out (S, B, H, T, D): the fused
                                          QKV rows (S = 3) to per-head q, k, v, or (S = 1) the
                                          output gradient to per-head rows
    from_heads(x, out)                    the inverse permutation: x (S, B, H, T, D) -> out
                                          (B, T, S, H, D)
    batched_gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False)
                                          out[g] (=|+=) op(a[g]) @ op(b[g]) for every g, all 3-D
    causal_softmax(scores, probs, scale)  scores, probs (G, T, T) (may be one array): probs[g, i]
                                          = softmax over j <= i of scale * scores[g, i, j], and
                                          0 where j > i
    causal_softmax_backward(probs, grad_probs, grad_scores, scale)
                                          grad_scores = scale * probs * (grad_probs - sum_j
                                          grad_probs * probs) per row, 0 where j > i (grad_probs
                                          and grad_scores may be one array)
Collective reductions (host ring and device buffers)
    reduce_into(dst, src, op)             dst = op(dst, src) elementwise, flat, op one of
                                          "sum", "min", "max", "prod"; any dtype of the API
"""
import importlib

_BACKENDS = {
    ("cpu", "numba"): "mpitrain.kernels.cpu",
    ("cuda", "cupy"): "mpitrain.kernels.cuda_cupy",
    ("cuda", "numba"): "mpitrain.kernels.cuda_numba",
}
_DEFAULT_FLAVOUR = {"cpu": "numba", "cuda": "cupy"}


def get(device="cpu", flavour=None):
    """The kernel module for ``device`` ("cpu" | "cuda") and ``flavour`` ("numba" | "cupy")."""
    if device not in _DEFAULT_FLAVOUR:
        raise ValueError(f"unknown device {device!r}; expected one of {sorted(_DEFAULT_FLAVOUR)}")
    flavour = flavour or _DEFAULT_FLAVOUR[device]
    key = (device, flavour)
    if key not in _BACKENDS:
        known = ", ".join(f"{d}/{f}" for d, f in _BACKENDS)
        raise ValueError(f"no kernels for device={device!r} kernels={flavour!r}; known: {known}")
    return importlib.import_module(_BACKENDS[key])
