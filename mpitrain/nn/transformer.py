"""The GPT (nanoGPT's model, GPT-2's architecture) and its layers: Embedding,
PositionalEmbedding, LayerNorm, GELU, CausalSelfAttention, MLP and Block.

Shapes: tokens ids (B, T) int64 with T <= block_size; activations (B, T, C), which every layer
treats as n = B*T rows of C channels; attention works on G = B*H groups, each head of D = C/H
channels. The layers follow layers.py: arithmetic only through ``self.kernels``, workspaces
kept between steps (sized by their number of elements here, so a shorter sequence or a smaller
batch reuses them), parameter gradients added into ``Parameter.grad`` with lazy zeroing.

Block (pre-LN residual)::

    x -> x + attn(ln_1(x)) -> h -> h + mlp(ln_2(h))

GPT: ``wte`` (token embedding) + ``wpe`` (position embedding), dropout, the blocks, ``ln_f`` and
the head ``logits = x @ wte.T``: the head shares the token embedding's Parameter (weight tying),
adds its gradient into that Parameter's ``.grad`` and reports nothing itself; the embedding's
backward, which runs last, adds the rest and reports ``wte``. Parameter names are nanoGPT's
(``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``, ...).

Initialisation (GPT-2's): normal(0, 0.02) for the Linear weights and both embeddings, zero
biases, normal(0, 0.02/sqrt(2*n_layer)) for the residual projections (``attn.c_proj``,
``mlp.c_proj``), LayerNorm weight 1 and bias 0; drawn on the host in float64 from one
``np.random.default_rng(seed)`` in construction order, then cast, so every process builds the
same model.
"""
import math

import numpy as np

from mpitrain.nn.layers import (Dropout, Layer, Linear, check_positive, generator,
                                  zeroed_grad)
from mpitrain.nn.module import Module, chain_backward, chain_forward
from mpitrain.nn.parameter import Parameter
from mpitrain.nn.sequential import Sequential

STD = 0.02          # GPT-2's initial standard deviation of the weights


def _normal_linear(in_features, out_features, std, rng, bias, dtype, kernels):
    """A Linear whose weight is normal(0, std) drawn from ``rng`` (biases zero)."""
    layer = Linear(in_features, out_features, dtype=dtype, kernels=kernels, bias=bias)
    w = rng.standard_normal((out_features, in_features)) * std
    layer.kernels.copy(layer.weight.data, layer.kernels.to_device(w.astype(layer.dtype)))
    return layer


class Embedding(Layer):
    """ids (B, T) (any integer shape) -> rows of ``weight`` (num, dim): (B, T, dim).

    Backward scatter-adds the output gradient into the rows of ``weight.grad`` the ids picked;
    there is no input gradient (the ids are integers).
    """

    def __init__(self, num_embeddings, embedding_dim, seed=0, dtype=np.float32, kernels=None,
                 std=STD):
        super().__init__(kernels, dtype)
        check_positive(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        w = generator(seed).standard_normal((num_embeddings, embedding_dim)) * std
        self.weight = self._params["weight"] = Parameter(w.astype(self.dtype), self.kernels)

    def forward(self, ids):
        if np.dtype(ids.dtype).kind not in "iu":
            raise ValueError(f"Embedding expects integer ids, got dtype {ids.dtype}")
        out = self.flat_workspace("y", tuple(ids.shape) + (self.embedding_dim,))  # (B, T, C)
        self.kernels.embedding_forward(ids, self.weight.data, out)
        self._ids = ids
        return out

    def backward(self, grad_y, need_input_grad=True):
        self.kernels.embedding_backward(self._ids, grad_y, zeroed_grad(self.weight))
        return None

    def __repr__(self):
        return f"Embedding({self.num_embeddings}, {self.embedding_dim})"


class PositionalEmbedding(Layer):
    """x (B, T, C) -> x + weight[:T], weight (block_size, C); its gradient is the output
    gradient summed over the batch, and the input gradient the output gradient itself."""

    def __init__(self, block_size, embedding_dim, seed=0, dtype=np.float32, kernels=None,
                 std=STD):
        super().__init__(kernels, dtype)
        check_positive(block_size=block_size, embedding_dim=embedding_dim)
        self.block_size, self.embedding_dim = block_size, embedding_dim
        w = generator(seed).standard_normal((block_size, embedding_dim)) * std
        self.weight = self._params["weight"] = Parameter(w.astype(self.dtype), self.kernels)

    def forward(self, x):
        self._check_input(x, 3, f"(B, T, {self.embedding_dim})")
        b, t, c = x.shape
        if t > self.block_size or c != self.embedding_dim:
            raise ValueError(f"PositionalEmbedding({self.block_size}, {self.embedding_dim}) "
                             f"got input shape {tuple(x.shape)}")
        k = self.kernels
        y = self.flat_workspace("y", (b, t * c))                                   # (B, T*C)
        k.copy(y, x.reshape((b, t * c)))
        k.bias_act(y, self.weight.data[:t].reshape(-1), False)
        self._t = t
        return y.reshape((b, t, c))

    def backward(self, grad_y, need_input_grad=True):
        b, t, c = grad_y.shape
        grad = zeroed_grad(self.weight)                               # (block_size, C)
        self.kernels.bias_grad(grad_y.reshape((b, t * c)), grad[:t].reshape(-1))
        return grad_y if need_input_grad else None

    def __repr__(self):
        return f"PositionalEmbedding({self.block_size}, {self.embedding_dim})"


class LayerNorm(Layer):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last axis (C); ``bias=False``
    leaves the bias out (nanoGPT's option)."""

    def __init__(self, normalized_shape, eps=1e-5, bias=True, dtype=np.float32, kernels=None):
        super().__init__(kernels, dtype)
        check_positive(normalized_shape=normalized_shape)
        self.normalized_shape, self.eps = normalized_shape, float(eps)
        c = normalized_shape
        self.weight = self._params["weight"] = Parameter(np.ones(c, self.dtype), self.kernels)
        self.bias = None
        if bias:
            self.bias = self._params["bias"] = Parameter(np.zeros(c, self.dtype), self.kernels)
        else:
            self._zeros = self.kernels.zeros((c,), self.dtype)
            self._bias_grad = self.kernels.zeros((c,), self.dtype)

    def forward(self, x):
        self._check_dtype(x)
        c = self.normalized_shape
        shape = tuple(x.shape)
        if len(shape) < 2 or shape[-1] != c:
            raise ValueError(f"LayerNorm({c}) expects (..., {c}), got shape {shape}")
        n = x.size // c
        y = self.flat_workspace("y", tuple(x.shape))                               # like x
        self._mean = self.flat_workspace("mean", (n,))                             # (n,)
        self._rstd = self.flat_workspace("rstd", (n,))
        bias = self._zeros if self.bias is None else self.bias.data
        self.kernels.layernorm_forward(x, self.weight.data, bias, y, self._mean, self._rstd,
                                       self.eps)
        self._x = x
        return y

    def backward(self, grad_y, need_input_grad=True):
        grad_w, acc = self.weight.grad_target()
        if self.bias is None:
            grad_b = self._bias_grad
        else:
            grad_b, acc_b = self.bias.grad_target()
            if acc_b != acc:                    # only one of the two was zeroed: align them
                if not acc_b:
                    self.kernels.fill(grad_b, 0)
                else:
                    self.kernels.fill(grad_w, 0)
                acc = True
        # the kernel always forms grad_x; a throwaway workspace when it is not needed
        grad_x = self.flat_workspace("grad_x", tuple(self._x.shape))
        self.kernels.layernorm_backward(grad_y, self._x, self._mean, self._rstd,
                                        self.weight.data, grad_x, grad_w, grad_b, acc)
        return grad_x if need_input_grad else None

    def __repr__(self):
        return (f"LayerNorm({self.normalized_shape}, eps={self.eps}"
                f"{'' if self.bias is not None else ', bias=False'})")


class GELU(Layer):
    """GPT-2's tanh approximation of GELU, elementwise (any shape)."""

    def forward(self, x):
        self._check_dtype(x)
        y = self.flat_workspace("y", tuple(x.shape))
        self.kernels.gelu(x, y)
        self._x = x
        return y

    def backward(self, grad_y, need_input_grad=True):
        if not need_input_grad:
            return None
        grad_x = self.flat_workspace("grad_x", tuple(grad_y.shape))
        self.kernels.gelu_backward(self._x, grad_y, grad_x)
        return grad_x

    def __repr__(self):
        return "GELU()"


class CausalSelfAttention(Layer):
    """Multi-head causal self-attention on (B, T, C): fused QKV projection ``c_attn`` (C -> 3C),
    softmax(q k^T / sqrt(D)) over the past and present, attention dropout, the heads' outputs
    joined and projected by ``c_proj`` (C -> C), residual dropout."""

    def __init__(self, n_embd, n_head, dropout=0.0, bias=True, seed=0, dtype=np.float32,
                 kernels=None, proj_std=STD):
        super().__init__(kernels, dtype)
        check_positive(n_embd=n_embd, n_head=n_head)
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        rng = generator(seed)
        self.n_embd, self.n_head, self.head_dim = n_embd, n_head, n_embd // n_head
        kw = dict(bias=bias, dtype=dtype, kernels=self.kernels)
        self.add_child("c_attn", _normal_linear(n_embd, 3 * n_embd, STD, rng, **kw))
        self.add_child("c_proj", _normal_linear(n_embd, n_embd, proj_std, rng, **kw))
        dk = dict(dtype=dtype, kernels=self.kernels)
        self.add_child("attn_dropout", Dropout(dropout, seed=rng, **dk))
        self.add_child("resid_dropout", Dropout(dropout, seed=rng, **dk))
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward_through(self, x):
        self._check_input(x, 3, f"(B, T, {self.n_embd})")
        b, t, c = x.shape
        h, d, k = self.n_head, self.head_dim, self.kernels
        g = b * h
        qkv = self.c_attn.forward_through(x)                            # (B, T, 3C)
        heads = self.flat_workspace("heads", (3, b, h, t, d))                      # q, k, v
        k.to_heads(qkv.reshape((b, t, 3, h, d)), heads)
        q, key, v = (heads[i].reshape((g, t, d)) for i in range(3))
        att = self.flat_workspace("att", (g, t, t))                                # (G, T, T)
        k.batched_gemm(q, key, att, trans_b=True)
        k.causal_softmax(att, att, self.scale)
        att_d = self.attn_dropout.forward_through(att)
        y = self.flat_workspace("y", (1, b, h, t, d))                              # (1, B, H, T, D)
        k.batched_gemm(att_d, v, y.reshape((g, t, d)))
        joined = self.flat_workspace("joined", (b, t, 1, h, d))                    # (B, T, 1, H, D)
        k.from_heads(y, joined)
        out = self.c_proj.forward_through(joined.reshape((b, t, c)))    # (B, T, C)
        self._shape, self._heads, self._att, self._att_d = (b, t, c), heads, att, att_d
        return self.resid_dropout.forward_through(out)

    def forward(self, x):
        return self.forward_through(x)

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        b, t, c = self._shape
        h, d, k = self.n_head, self.head_dim, self.kernels
        g = b * h
        gy = self.resid_dropout.backward_through(grad_y, True, on_layer_done)
        gy = self.c_proj.backward_through(gy, True, on_layer_done)     # (B, T, C)
        gy_heads = self.flat_workspace("gy_heads", (1, b, h, t, d))
        k.to_heads(gy.reshape((b, t, 1, h, d)), gy_heads)
        gy3 = gy_heads.reshape((g, t, d))
        q, key, v = (self._heads[i].reshape((g, t, d)) for i in range(3))
        d_heads = self.flat_workspace("d_heads", (3, b, h, t, d))
        dq, dk, dv = (d_heads[i].reshape((g, t, d)) for i in range(3))
        d_att = self.flat_workspace("d_att", (g, t, t))                            # (G, T, T)
        k.batched_gemm(gy3, v, d_att, trans_b=True)
        k.batched_gemm(self._att_d, gy3, dv, trans_a=True)
        d_att = self.attn_dropout.backward_through(d_att, True, on_layer_done)
        k.causal_softmax_backward(self._att, d_att, d_att, self.scale)
        k.batched_gemm(d_att, key, dq)
        k.batched_gemm(d_att, q, dk, trans_a=True)
        d_qkv = self.flat_workspace("d_qkv", (b, t, 3, h, d))
        k.from_heads(d_heads, d_qkv)
        return self.c_attn.backward_through(d_qkv.reshape((b, t, 3 * c)), need_input_grad,
                                            on_layer_done)

    def extra_repr(self):
        return f"n_embd={self.n_embd}, n_head={self.n_head}"


class MLP(Module):
    """Linear C -> 4C, GELU, Linear 4C -> C, dropout (children c_fc, gelu, c_proj, dropout)."""

    def __init__(self, n_embd, dropout=0.0, bias=True, seed=0, dtype=np.float32, kernels=None,
                 proj_std=STD):
        super().__init__()
        rng = generator(seed)
        kw = dict(bias=bias, dtype=dtype, kernels=kernels)
        self.add_child("c_fc", _normal_linear(n_embd, 4 * n_embd, STD, rng, **kw))
        self.kernels = self.c_fc.kernels
        self.add_child("gelu", GELU(dtype=dtype, kernels=self.kernels))
        self.add_child("c_proj", _normal_linear(4 * n_embd, n_embd, proj_std, rng, **kw))
        self.add_child("dropout", Dropout(dropout, seed=rng, dtype=dtype, kernels=self.kernels))
        self._chain = self.children()

    def forward_through(self, x):
        return chain_forward(self._chain, x)

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        return chain_backward(self._chain, grad_y, need_input_grad, on_layer_done)


class Block(Layer):
    """Pre-LN transformer block: h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))."""

    def __init__(self, n_embd, n_head, dropout=0.0, bias=True, seed=0, dtype=np.float32,
                 kernels=None, proj_std=STD):
        super().__init__(kernels, dtype)
        rng = generator(seed)
        kw = dict(dtype=dtype, kernels=self.kernels)
        self.add_child("ln_1", LayerNorm(n_embd, bias=bias, **kw))
        self.add_child("attn", CausalSelfAttention(n_embd, n_head, dropout, bias, seed=rng,
                                                   proj_std=proj_std, **kw))
        self.add_child("ln_2", LayerNorm(n_embd, bias=bias, **kw))
        self.add_child("mlp", MLP(n_embd, dropout, bias, seed=rng, proj_std=proj_std, **kw))

    def _residual(self, key, a, b):
        out = self.flat_workspace(key, tuple(a.shape))
        self.kernels.copy(out, a)
        self.kernels.add(out, b)
        return out

    def forward_through(self, x):
        self._check_dtype(x)
        h = self._residual("h", x, self.attn.forward_through(self.ln_1.forward_through(x)))
        return self._residual("y", h, self.mlp.forward_through(self.ln_2.forward_through(h)))

    def forward(self, x):
        return self.forward_through(x)

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        g = self.mlp.backward_through(grad_y, True, on_layer_done)
        g = self.ln_2.backward_through(g, True, on_layer_done)
        grad_h = self._residual("grad_h", grad_y, g)
        g = self.attn.backward_through(grad_h, True, on_layer_done)
        g = self.ln_1.backward_through(g, True, on_layer_done)
        return self._residual("grad_x", grad_h, g) if need_input_grad else None


class _TiedHead(Layer):
    """logits (B, T, V) = x (B, T, C) @ weight.T for a Parameter owned elsewhere (the token
    embedding's): its gradient is added into that Parameter, which this layer does not list."""

    def __init__(self, weight, dtype=np.float32, kernels=None):
        super().__init__(kernels, dtype)
        self._weight = weight

    def used_parameters(self):
        return [self._weight]

    def forward(self, x):
        b, t, c = x.shape
        w = self._weight.data                                           # (V, C)
        logits = self.flat_workspace("logits", (b, t, w.shape[0]))                 # (B, T, V)
        self._x = x.reshape((b * t, c))
        self.kernels.gemm(self._x, w, logits.reshape((b * t, w.shape[0])), trans_b=True)
        return logits

    def backward(self, grad_y, need_input_grad=True):
        b, t, v = grad_y.shape
        g = grad_y.reshape((b * t, v))                                  # (n, V)
        grad_w, acc = self._weight.grad_target()                        # (V, C)
        self.kernels.gemm(g, self._x, grad_w, trans_a=True, accumulate=acc)
        if not need_input_grad:
            return None
        grad_x = self.flat_workspace("grad_x", (b, t, self._x.shape[1]))           # (B, T, C)
        self.kernels.gemm(g, self._weight.data, grad_x.reshape(self._x.shape))
        return grad_x

    def __repr__(self):
        return f"LMHead({self._weight.shape[1]}, {self._weight.shape[0]}, tied)"


class GPT(Module):
    """nanoGPT's GPT: ``forward(ids (B, T) int64) -> logits (B, T, vocab_size)`` (a fresh
    array), T <= block_size; ``backward(grad_logits)``; ``generate(ids, max_new_tokens)``."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0, bias=True,
                 seed=0, dtype=np.float32, kernels=None):
        super().__init__()
        check_positive(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                  n_embd=n_embd)
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        self.vocab_size, self.block_size, self.n_layer = vocab_size, block_size, n_layer
        self.n_head, self.n_embd, self.dropout, self.bias = n_head, n_embd, dropout, bool(bias)
        rng = np.random.default_rng(seed)
        kw = dict(dtype=dtype, kernels=kernels)
        tr = Module()
        tr.add_child("wte", Embedding(vocab_size, n_embd, seed=rng, **kw))
        self.kernels = tr.wte.kernels
        self.dtype = tr.wte.dtype
        kw["kernels"] = self.kernels
        tr.add_child("wpe", PositionalEmbedding(block_size, n_embd, seed=rng, **kw))
        tr.add_child("drop", Dropout(dropout, seed=rng, **kw))
        proj_std = STD / math.sqrt(2 * n_layer)
        tr.add_child("h", Sequential(*[Block(n_embd, n_head, dropout, bias, seed=rng,
                                             proj_std=proj_std, **kw) for _ in range(n_layer)]))
        tr.add_child("ln_f", LayerNorm(n_embd, bias=bias, **kw))
        self.add_child("transformer", tr)
        self.add_child("lm_head", _TiedHead(tr.wte.weight, **kw))
        self.input_shape = (block_size,)

    def forward_through(self, ids):
        if ids.ndim != 2 or np.dtype(ids.dtype).kind not in "iu":
            raise ValueError(f"GPT expects integer token ids (B, T), got shape "
                             f"{tuple(ids.shape)} dtype {ids.dtype}")
        if not 0 < ids.shape[1] <= self.block_size:
            raise ValueError(f"sequence length {ids.shape[1]} is not in [1, block_size "
                             f"{self.block_size}]")
        tr = self.transformer
        x = tr.wte.forward_through(ids)                                 # (B, T, C)
        x = tr.wpe.forward_through(x)
        x = tr.drop.forward_through(x)
        x = tr.h.forward_through(x)
        x = tr.ln_f.forward_through(x)
        return self.lm_head.forward_through(x)                          # (B, T, V)

    def backward_through(self, grad_y, need_input_grad, on_layer_done):
        tr = self.transformer
        g = self.lm_head.backward_through(grad_y, True, on_layer_done)   # into wte.grad
        g = tr.ln_f.backward_through(g, True, on_layer_done)
        g = tr.h.backward_through(g, True, on_layer_done)
        g = tr.drop.backward_through(g, True, on_layer_done)
        g = tr.wpe.backward_through(g, True, on_layer_done)
        tr.wte.backward_through(g, False, on_layer_done)                # wte's last part
        return None                                                     # ids: no gradient

    def generate(self, ids, max_new_tokens, temperature=1.0, seed=0):
        """``ids`` (B, T) (or (T,)) host ints extended by ``max_new_tokens`` tokens, each
        predicted from the last ``block_size`` ones: the argmax when ``temperature`` is 0, else
        a draw from softmax(logits / temperature) (``np.random.default_rng(seed)``). Runs in
        eval mode and restores the mode; returns an int64 host array."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        out = np.array(ids, dtype=np.int64)
        single = out.ndim == 1
        if single:
            out = out[None, :]
        if out.ndim != 2 or out.shape[1] == 0:
            raise ValueError(f"generate expects token ids (B, T) with T > 0, got shape "
                             f"{np.shape(ids)}")
        rng = np.random.default_rng(seed)
        mode = self.training
        self.eval()
        try:
            for _ in range(int(max_new_tokens)):
                ctx = np.ascontiguousarray(out[:, -self.block_size:])
                logits = self.kernels.to_host(self.forward(self.kernels.to_device(ctx)))
                last = np.asarray(logits[:, -1, :], dtype=np.float64)   # (B, V)
                if temperature == 0:
                    nxt = last.argmax(axis=1)
                else:
                    z = last / temperature
                    p = np.exp(z - z.max(axis=1, keepdims=True))
                    p /= p.sum(axis=1, keepdims=True)
                    nxt = np.array([rng.choice(p.shape[1], p=row) for row in p])
                out = np.concatenate([out, nxt.astype(np.int64)[:, None]], axis=1)
        finally:
            self.train(mode)
        return out[0] if single else out

    def extra_repr(self):
        return (f"vocab_size={self.vocab_size}, block_size={self.block_size}, "
                f"n_layer={self.n_layer}, n_head={self.n_head}, n_embd={self.n_embd}")
