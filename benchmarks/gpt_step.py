"""Time one GPT training step (forward, cross-entropy, backward) here and in PyTorch.

    python benchmarks/gpt_step.py [--steps 20] [--rounds 5] [--threads 1] [--json PATH]
        [--profile]
    python benchmarks/gpt_step.py --device cuda --kernels cupy|numba [--no-torch]
        --batch 64 --block-size 256 --n-layer 6 --n-head 6 --n-embd 384

The model is the zoo's ``gpt`` (nanoGPT's GPT) in its "baby" configuration by default: 4 layers,
4 heads, 128 channels, block 64, batch 12, vocabulary 65, no dropout, float32. The PyTorch model
is nanoGPT's model.py (the same modules, F.scaled_dot_product_attention with is_causal=True),
built in this process with our weights copied in, so both compute the same function: the script
prints the two losses of the first batch as a check. The optimizer step is left out of both.

Every round times ``--steps`` steps of ours, then as many of PyTorch's, back to back on the same
load; the best round of each is reported with the ratio ours / PyTorch (below 1: ours is faster)
and the ratio within each round. Threads (default 1) are fixed before NumPy and PyTorch load:
BLAS and Numba here, ``torch.set_num_threads`` there. ``--profile`` adds ours per kernel.

``--device cuda`` runs ours on the GPU with the ``--kernels`` flavour (CuPy by default, or Numba
CUDA; the ids and targets copied over once) and PyTorch's model on "cuda" with TF32 off for
matrix products and cuDNN, so both compute in float32; the weights go from ours to PyTorch's
through host arrays. Launches are asynchronous: each timing starts and ends with the device
synchronized (ours ``kernels.synchronize``, PyTorch ``torch.cuda.synchronize``). A flavour that
cannot load, or a torch that sees no GPU (without ``--no-torch``), is one line and exit 2.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))    # benchdeps, also when loaded by path
import benchdeps  # noqa: E402
import benchutil  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--threads", type=int, default=1, help="BLAS, Numba and torch threads")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kernels", default=None, choices=("numba", "cupy"),
                    help="kernel flavour (default: numba on cpu, cupy on cuda)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (ours, then PyTorch)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (JIT, workspaces)")
    ap.add_argument("--no-torch", action="store_true", help="time ours only")
    ap.add_argument("--profile", action="store_true",
                    help="also print ours per kernel (ms per step)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("batch", "block_size", "n_layer", "n_head", "n_embd",
                                        "vocab", "threads", "steps", "rounds"))
    if args.n_embd % args.n_head:
        ap.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.device == "cpu" and args.kernels == "cupy":
        ap.error("--kernels cupy runs on the GPU: use it with --device cuda")
    return args


def torch_gpt(vocab, block_size, n_layer, n_head, n_embd):
    """nanoGPT's GPT (model.py, dropout 0, bias True), without its own initialisation."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
            self.c_proj = nn.Linear(n_embd, n_embd)

        def forward(self, x):
            b, t, c = x.size()
            q, k, v = self.c_attn(x).split(n_embd, dim=2)
            k = k.view(b, t, n_head, c // n_head).transpose(1, 2)
            q = q.view(b, t, n_head, c // n_head).transpose(1, 2)
            v = v.view(b, t, n_head, c // n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                               is_causal=True)
            y = y.transpose(1, 2).contiguous().view(b, t, c)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(n_embd, 4 * n_embd)
            self.gelu = nn.GELU(approximate="tanh")
            self.c_proj = nn.Linear(4 * n_embd, n_embd)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(n_embd)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(n_embd)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([Block() for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
            self.lm_head = nn.Linear(n_embd, vocab, bias=False)
            self.transformer.wte.weight = self.lm_head.weight       # tied

        def forward(self, idx, targets):
            t = idx.size(1)
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(self.transformer.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return GPT()


def copy_weights(ours, net):
    """Our parameters into the PyTorch model (the names are nanoGPT's), through host arrays:
    either model may live on a GPU."""
    import torch
    theirs = dict(net.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            theirs[name].copy_(torch.from_numpy(ours.kernels.to_host(p.data)))


def main(argv=None):
    args = parse_args(argv)
    benchutil.set_threads(args.threads)
    if not args.no_torch:
        benchdeps.require_or_exit("torch", "the PyTorch comparison (or --no-torch)", "gpt_step")
        if args.device == "cuda":
            import torch
            if not torch.cuda.is_available():
                benchdeps.fail("gpt_step", f"the PyTorch comparison on --device cuda needs a "
                               f"torch that sees the GPU (torch {torch.__version__}: "
                               f"torch.cuda.is_available() is False; or --no-torch)")
    import numpy as np

    import mpitrain as mt
    from mpitrain import kernels as registry
    from mpitrain.runtime import threads

    threads.configure(args.threads)
    try:
        k = registry.get(args.device, args.kernels)
    except ImportError as exc:          # the flavour's own one line: no CuPy, no device, ...
        benchdeps.fail("gpt_step", " ".join(str(exc).split()))
    model = mt.models.get("gpt", vocab_size=args.vocab, block_size=args.block_size,
                          n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                          kernels=k)
    loss_fn = mt.nn.SoftmaxCrossEntropy(kernels=k)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.block_size)
    x = rng.integers(0, args.vocab, shape, dtype=np.int64)               # (B, T) host
    y = rng.integers(0, args.vocab, shape, dtype=np.int64)
    dx, dy = k.to_device(x), k.to_device(y)                             # (B, T) on the device

    def ours():
        model.zero_grad()
        loss = loss_fn(model.forward_through(dx), dy)
        model.backward(loss_fn.backward())
        return loss

    ours_loss = ours()
    for _ in range(args.warmup):
        ours()
    k.synchronize()
    torch_sync = None
    if not args.no_torch:
        import torch
        torch.set_num_threads(args.threads)
        if args.device == "cuda":
            # our kernels compute in float32; PyTorch's CUDA default may use TF32
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch_sync = torch.cuda.synchronize
        net = torch_gpt(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
        copy_weights(model, net)
        net = net.to(args.device)
        tx, ty = torch.from_numpy(x).to(args.device), torch.from_numpy(y).to(args.device)

        def torch_run():
            net.zero_grad(set_to_none=True)
            loss = net(tx, ty)
            loss.backward()
            return loss

        torch_loss = float(torch_run().detach())
        for _ in range(args.warmup):
            torch_run()
        if torch_sync is not None:
            torch_sync()
        print(f"first-batch loss: ours {ours_loss:.6f}, PyTorch {torch_loss:.6f}")

    def per_step(fn, sync=None):
        """ms per step of ``steps`` calls of ``fn``, the device idle at both clock readings."""
        def steps():
            for _ in range(args.steps):
                fn()
        return benchutil.timed(steps, sync, sync) / args.steps * 1e3

    rounds = []
    for _ in range(args.rounds):
        r = {"ours_ms": per_step(ours, k.synchronize)}
        if not args.no_torch:
            r["torch_ms"] = per_step(torch_run, torch_sync)
            r["ratio"] = r["ours_ms"] / r["torch_ms"]
        rounds.append(r)
    best = min(r["ours_ms"] for r in rounds)
    res = dict(config=dict(batch=args.batch, block_size=args.block_size, n_layer=args.n_layer,
                           n_head=args.n_head, n_embd=args.n_embd, vocab=args.vocab,
                           dtype="float32", threads=args.threads, device=args.device,
                           kernels=k.name),
               ours_loss=float(ours_loss), ours_ms=best,
               ours_ms_median=float(np.median([r["ours_ms"] for r in rounds])), rounds=rounds,
               tokens_per_s=args.batch * args.block_size / best * 1e3)
    line = f"ours {best:.2f} ms/step"
    if not args.no_torch:
        best_torch = min(r["torch_ms"] for r in rounds)
        res.update(torch_ms=best_torch, torch_version=torch.__version__,
                   torch_device=args.device, torch_loss=torch_loss,
                   ratio=best / best_torch, ratio_rounds=[r["ratio"] for r in rounds])
        if args.device == "cuda":
            res.update(torch_gpu=torch.cuda.get_device_name(0), torch_tf32=False)
        line += (f", torch {best_torch:.2f} ms/step (PyTorch {torch.__version__}), ratio "
                 f"{best / best_torch:.3f} (within rounds {min(res['ratio_rounds']):.3f} .. "
                 f"{max(res['ratio_rounds']):.3f})")
    where = f"{args.threads} thread(s)" if args.device == "cpu" else k.name
    print(f"GPT {args.n_layer}x{args.n_embd} h{args.n_head} T{args.block_size} B{args.batch} "
          f"V{args.vocab}, {where}: {line}")
    if args.profile:
        res["profile_ms"] = profile(k, ours, args.steps, sync=args.device != "cpu")
        for key, ms in sorted(res["profile_ms"].items(), key=lambda kv: -kv[1]):
            print(f"  {ms:8.3f} ms  {key}")
    if args.json:
        benchutil.write_json(args.json, res)
    return res


def profile(k, step, steps, sync=False):
    """ms per step in each kernel (by name and first argument's shape), and "python" for the
    rest of the step (the layers' own code). ``sync``: the device is synchronized after each
    kernel call (a GPU's launches return before the work is done)."""
    from collections import defaultdict
    from mpitrain.kernels import contract
    spent, saved = defaultdict(float), {}
    synchronize = k.synchronize             # itself a contract kernel: wrapped below

    def wrap(name, fn):
        def timed_call(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            if sync:
                synchronize()
            key = f"{name} {tuple(a[0].shape)}" if a and hasattr(a[0], "shape") else name
            spent[key] += time.perf_counter() - t
            return out
        return timed_call

    def run():
        for _ in range(steps):
            step()

    for name in contract.KERNELS:
        if hasattr(k, name):
            saved[name] = getattr(k, name)
            setattr(k, name, wrap(name, saved[name]))
    try:
        total = benchutil.timed(run, synchronize, synchronize)
    finally:
        for name, fn in saved.items():
            setattr(k, name, fn)
    out = {key: s / steps * 1e3 for key, s in spent.items()}
    out["(rest: python)"] = (total - sum(spent.values())) / steps * 1e3
    out["(total)"] = total / steps * 1e3
    return out


if __name__ == "__main__":
    main()
