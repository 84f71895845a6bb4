"""The GPT's layers and model: finite-difference gradient checks in float64, weight tying, the
(B, T, V) cross-entropy, generation, the zoo entry, and a forward against PyTorch."""
import numpy as np
import pytest

import mpitrain as mt
from mpitrain.nn import (GELU, GPT, Block, CausalSelfAttention, Dropout, Embedding, LayerNorm,
                         Linear, PositionalEmbedding, SoftmaxCrossEntropy)
from tests.support.gradcheck import assert_close, check_layer, check_module, numeric_grad

F64 = dict(dtype=np.float64)


@pytest.fixture
def rng():
    return np.random.default_rng(4321)


def tiny_gpt(**kw):
    cfg = dict(vocab_size=11, block_size=5, n_layer=2, n_head=2, n_embd=8, seed=3)
    cfg.update(kw)
    return GPT(**cfg)


def randomize(model, rng):
    """Nonzero biases and LayerNorm parameters (the zero init would hide their gradients)."""
    for name, p in model.named_parameters():
        if not name.endswith("weight") or "ln" in name:
            p.data[...] = rng.standard_normal(p.shape) * 0.3 + ("ln" in name and "weight" in name)


def test_embedding_gradient(rng):
    layer = Embedding(6, 4, seed=1, **F64)
    ids = np.array([[1, 5, 1], [0, 1, 3]])
    r = rng.standard_normal((2, 3, 4))

    def loss():
        return float(np.sum(layer.forward(ids) * r))

    np.testing.assert_array_equal(layer.forward(ids), layer.weight.data[ids])
    layer.zero_grad()
    assert layer.backward(r) is None
    assert_close(np.array(layer.weight.grad), numeric_grad(loss, layer.weight.data), "wte")


def test_positional_embedding_gradient_shorter_t(rng):
    check_layer(PositionalEmbedding(5, 4, seed=2, **F64), rng.standard_normal((2, 3, 4)), rng)


@pytest.mark.parametrize("shape", [(3, 6), (2, 3, 6)])
def test_layernorm_gradient(rng, shape):
    layer = LayerNorm(6, **F64)
    layer.weight.data[:] = rng.standard_normal(6)
    layer.bias.data[:] = rng.standard_normal(6)
    check_layer(layer, rng.standard_normal(shape) * 2 + 1, rng)


def test_layernorm_without_bias(rng):
    layer = LayerNorm(6, bias=False, **F64)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    check_layer(layer, rng.standard_normal((4, 6)), rng)


def test_gelu_gradient(rng):
    check_layer(GELU(**F64), rng.standard_normal((2, 3, 5)) * 2, rng)


def test_linear_3d_gradient_and_same_as_2d(rng):
    layer = Linear(5, 4, seed=1, **F64)
    layer.bias.data[:] = rng.standard_normal(4)
    check_layer(layer, rng.standard_normal((2, 3, 5)), rng)
    x = rng.standard_normal((2, 3, 5))
    y3 = np.array(layer.forward(x))
    assert y3.shape == (2, 3, 4)
    np.testing.assert_array_equal(y3.reshape(6, 4), layer.forward(x.reshape(6, 5)))
    g = rng.standard_normal((2, 3, 4))
    layer.zero_grad()
    gx3 = np.array(layer.backward(g))
    gw3 = np.array(layer.weight.grad)
    layer.forward(x.reshape(6, 5))
    layer.zero_grad()
    np.testing.assert_array_equal(gx3.reshape(6, 5), layer.backward(g.reshape(6, 4)))
    np.testing.assert_array_equal(gw3, layer.weight.grad)


def test_linear_without_bias(rng):
    layer = Linear(5, 4, seed=1, bias=False, **F64)
    assert [n for n, _ in layer.named_parameters()] == ["weight"]
    check_layer(layer, rng.standard_normal((3, 5)), rng)


@pytest.mark.parametrize("t", [4, 1])
def test_attention_gradient(rng, t):
    attn = CausalSelfAttention(8, 2, seed=5, **F64)
    randomize(attn, rng)
    check_module(attn, rng.standard_normal((2, t, 8)), rng)


def test_attention_is_causal(rng):
    attn = CausalSelfAttention(8, 2, seed=5, **F64)
    x = rng.standard_normal((1, 4, 8))
    y = np.array(attn.forward_through(x))
    x2 = x.copy()
    x2[0, 3] += 1.0                                  # the last token changes the last row only
    y2 = np.array(attn.forward_through(x2))
    np.testing.assert_array_equal(y[0, :3], y2[0, :3])
    assert not np.allclose(y[0, 3], y2[0, 3])


def test_block_gradient(rng):
    block = Block(8, 2, seed=6, **F64)
    randomize(block, rng)
    check_module(block, rng.standard_normal((2, 3, 8)), rng)


def test_head_dims_must_divide():
    with pytest.raises(ValueError, match="n_embd 10 is not a multiple of n_head 3"):
        GPT(11, 5, 1, 3, 10)
    with pytest.raises(ValueError, match="n_embd"):
        CausalSelfAttention(10, 4)


def test_tiny_gpt_gradient_through_the_loss(rng):
    model = tiny_gpt(**F64)
    randomize(model, rng)
    ids = rng.integers(0, 11, (2, 5))
    targets = rng.integers(0, 11, (2, 5))
    loss_fn = SoftmaxCrossEntropy()

    def loss():
        return loss_fn(model.forward_through(ids), targets)

    loss()
    model.zero_grad()
    model.backward(loss_fn.backward())
    for name, p in model.named_parameters():
        assert_close(np.array(p.grad), numeric_grad(loss, p.data), name)


def test_weight_tying(rng):
    model = tiny_gpt(**F64)
    names = [n for n, _ in model.named_parameters()]
    assert names[:3] == ["transformer.wte.weight", "transformer.wpe.weight",
                         "transformer.h.0.ln_1.weight"]
    assert "transformer.h.1.attn.c_attn.weight" in names and len(set(names)) == len(names)
    wte = model.transformer.wte.weight
    assert sum(p is wte for p in model.parameters()) == 1
    ids = rng.integers(0, 11, (2, 4))
    r = rng.standard_normal((2, 4, 11))
    done = []
    model.forward_through(ids)
    model.zero_grad()
    model.backward(r, on_layer_done=lambda ps: done.extend(ps))
    assert done[-1] is wte and sum(p is wte for p in done) == 1
    total = np.array(wte.grad)
    # the head's part: d/dW of sum(r * x @ W.T) = r^T x, with x the final LayerNorm's output
    x = np.array(model.transformer.ln_f.forward_through(
        model.transformer.h.forward_through(model.transformer.wpe.forward_through(
            model.transformer.wte.forward_through(ids)))))
    head = r.reshape(-1, 11).T @ x.reshape(-1, 8)
    emb = total - head
    assert np.abs(emb[np.setdiff1d(np.arange(11), ids)]).max() < 1e-12   # unused ids: head only
    assert np.abs(emb[ids[0, 0]]).max() > 1e-6


def test_every_parameter_reported_once_last_wte(rng):
    model = tiny_gpt()
    ids = rng.integers(0, 11, (2, 5))
    model.forward_through(ids)
    groups = []
    model.backward(np.ones((2, 5, 11), np.float32), on_layer_done=groups.append)
    # layers finish in the reverse of parameters() order
    assert [id(p) for g in reversed(groups) for p in g] == [id(p) for p in model.parameters()]
    assert groups[-1] == [model.transformer.wte.weight]


def test_gpt_init_and_determinism():
    a, b, c = tiny_gpt(n_layer=3), tiny_gpt(n_layer=3), tiny_gpt(n_layer=3, seed=4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
        if "ln" in name and name.endswith("weight"):
            assert np.all(p.data == 1)
        elif "ln" in name or name.endswith("bias"):
            assert np.all(p.data == 0)
        else:
            assert not np.array_equal(p.data, r.data)
    big = GPT(50, 64, 4, 4, 64, seed=0)
    params = dict(big.named_parameters())
    assert abs(params["transformer.h.0.mlp.c_fc.weight"].data.std() - 0.02) < 2e-3
    assert abs(params["transformer.h.0.mlp.c_proj.weight"].data.std()
               - 0.02 / np.sqrt(8)) < 1e-3
    assert big.input_shape == (64,) and big.parameters()[0].dtype == np.float32


def test_gpt_shorter_sequence_and_bad_input(rng):
    model = tiny_gpt()
    logits = model.forward(rng.integers(0, 11, (3, 2)))
    assert logits.shape == (3, 2, 11) and logits.dtype == np.float32
    with pytest.raises(ValueError, match="block_size 5"):
        model.forward(rng.integers(0, 11, (1, 6)))
    with pytest.raises(ValueError, match="integer token ids"):
        model.forward(rng.standard_normal((1, 3)))


def test_prefix_logits_do_not_depend_on_later_tokens(rng):
    model = tiny_gpt()
    ids = rng.integers(0, 11, (2, 5))
    full = model.forward(ids)
    np.testing.assert_allclose(model.forward(ids[:, :3]), full[:, :3], rtol=1e-5, atol=1e-6)


def test_loss_on_sequences(rng):
    logits = rng.standard_normal((2, 3, 5)) * 2
    labels = rng.integers(0, 5, (2, 3))
    seq, flat = SoftmaxCrossEntropy(), SoftmaxCrossEntropy()
    value = seq(logits, labels)
    assert value == flat(logits.reshape(6, 5), labels.reshape(6))
    assert seq.backward().shape == (2, 3, 5)
    np.testing.assert_array_equal(seq.backward().reshape(6, 5), flat.backward())
    assert seq.correct == int((logits.argmax(-1) == labels).sum())
    assert_close(np.array(seq.backward()), numeric_grad(lambda: seq(logits, labels), logits),
                 "xent (B, T, V)")
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 3\)"):
        seq(logits, labels.reshape(6))


def test_generate(rng):
    model = tiny_gpt()
    model.train()
    prompt = rng.integers(0, 11, (2, 3))
    a = model.generate(prompt, 6, temperature=0)
    assert a.shape == (2, 9) and a.dtype == np.int64 and model.training
    np.testing.assert_array_equal(a[:, :3], prompt)
    np.testing.assert_array_equal(a, model.generate(prompt, 6, temperature=0))
    # each greedy token is the argmax of the logits of the last block_size tokens
    for i in range(3, 9):
        ctx = a[:, max(0, i - 5):i]
        np.testing.assert_array_equal(a[:, i], model.forward(ctx)[:, -1].argmax(-1))
    s1, s2 = (model.generate(prompt[0], 6, temperature=1.0, seed=7) for _ in range(2))
    assert s1.shape == (9,)
    np.testing.assert_array_equal(s1, s2)


def test_dropout_layers_are_seedable(rng):
    model = tiny_gpt(dropout=0.3)
    drops = [m for m in model.modules() if isinstance(m, Dropout)]
    assert len(drops) == 1 + 2 * 3            # embedding; attention, residual, MLP per block
    ids = rng.integers(0, 11, (2, 5))

    def run():
        for d in drops:
            d.calls = 5
        return model.forward(ids)

    np.testing.assert_array_equal(run(), run())
    model.eval()
    e1 = model.forward(ids)
    model.train()
    assert not np.allclose(run(), e1)


def test_dropout_gradient_fixed_masks(rng):
    model = tiny_gpt(dropout=0.2, **F64)
    ids, targets = rng.integers(0, 11, (2, 5)), rng.integers(0, 11, (2, 5))
    loss_fn = SoftmaxCrossEntropy()
    drops = [m for m in model.modules() if isinstance(m, Dropout)]

    def loss():
        for d in drops:
            d.calls = 1
        return loss_fn(model.forward_through(ids), targets)

    loss()
    model.zero_grad()
    model.backward(loss_fn.backward())
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.wte.weight"):
        p = dict(model.named_parameters())[name]
        assert_close(np.array(p.grad), numeric_grad(loss, p.data), name)


def test_zoo_entry():
    model = mt.models.get("gpt", vocab_size=13, n_layer=1, n_embd=16, n_head=2, block_size=8)
    assert isinstance(model, GPT) and model.input_shape == (8,)
    assert "gpt" in mt.models.names


def test_forward_matches_pytorch(rng):
    torch = pytest.importorskip("torch")
    from torch.nn import functional as F
    model = tiny_gpt()
    randomize(model, rng)
    p = {n: torch.from_numpy(np.array(q.data)) for n, q in model.named_parameters()}
    ids = rng.integers(0, 11, (3, 5))
    c, h = 8, 2

    def ln(x, pre):
        return F.layer_norm(x, (c,), p[pre + ".weight"], p[pre + ".bias"], 1e-5)

    def lin(x, pre):
        return F.linear(x, p[pre + ".weight"], p[pre + ".bias"])

    with torch.no_grad():
        idx = torch.from_numpy(ids)
        x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:5]
        for i in range(2):
            pre = f"transformer.h.{i}."
            q, k, v = lin(ln(x, pre + "ln_1"), pre + "attn.c_attn").split(c, dim=2)
            q, k, v = (a.view(3, 5, h, c // h).transpose(1, 2) for a in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(3, 5, c)
            x = x + lin(y, pre + "attn.c_proj")
            m = F.gelu(lin(ln(x, pre + "ln_2"), pre + "mlp.c_fc"), approximate="tanh")
            x = x + lin(m, pre + "mlp.c_proj")
        want = F.linear(ln(x, "transformer.ln_f"), p["transformer.wte.weight"]).numpy()
    np.testing.assert_allclose(model.forward(ids), want, rtol=1e-5, atol=1e-5)
