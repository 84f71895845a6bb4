"""make gpu-check: everything the GPU needs, in one command, into one JSON report and one log.

    python3 tools/gpu_check.py [--quick] [--out out/gpu-check] [--only STEP ...]
                               [--skip STEP ...] [--budget SECONDS] [--dry-run]

The steps, in order (each run is a subprocess with its own timeout):

    nvidia-smi  GPU facts: names, driver, memory, compute capability, clocks, PCIe
    kernels     every CuPy and Numba CUDA kernel against the CPU kernel (tests/gpu/test_gpu_kernels)
    train       python -m mpitrain, each zoo model, --device cuda x {cupy, numba} vs --device cpu:
                the --save parameters after 3 steps must agree within rtol 1e-3, atol 1e-5
    tests-1     pytest -m gpu tests/gpu (the rest) on 1 rank
    tests-2     the same under mpiexec -n 2, both ranks sharing GPU 0
    memcpy      benchmarks/gpu_kernels.py: device-to-device copy (the bandwidth reference), every
                memory-bound kernel's share of it, GEMM GFLOP/s
    step        benchmarks/step.py --device cuda, every model, batch 64 and 256, both flavours,
                with --torch (PyTorch CUDA, same network) when torch sees the GPU
    allreduce   benchmarks/allreduce_device.py per transport: host staging and CUDA-aware MPI on
                2 ranks sharing the GPU; NCCL with one rank per GPU (needs >= 2 GPUs); references
                cupy.cuda.nccl / torch all_reduce in the same run
    timeline    mpiexec -n 2 python -m mpitrain --device cuda --timeline: trace + per-rank summary
    gpt         benchmarks/gpt_step.py --device cuda, both flavours: one GPT training step (6
                layers, 6 heads, 384 wide, block 256, batch 64) against PyTorch CUDA's (the same
                model and weights, TF32 off) when torch sees the GPU; first-batch losses
                agree (last: the budget goes to the earlier steps first)

--quick (about 3 minutes, budget 180 s instead of 540 s): lenet only in train, tests-1 without
the CLI test (train does that comparison), batch 64 only, fewer rounds and steps (step, gpt),
smaller memcpy and allreduce sizes, the host transport only. A run starts only if its usual
time (else its timeout) fits in what is left of the budget; the rest, and a run the budget cuts
off, are skipped ("time budget spent"); --only/--skip pick steps, so a second call can do the
rest. A run killed by its own timeout failed. Every run shares one Numba cache
(NUMBA_CACHE_DIR, in the temp dir unless set), so the kernels and train steps compile what the
timed steps then load.

Before planning, a probe compiles and runs one 4-element kernel per flavour (CuPy: NVRTC;
Numba: NVVM): a flavour that cannot is one "flavour unusable: reason" line, and its runs and
tests are skipped.

A run whose prerequisite is missing (no mpiexec, no CuPy, no torch, one GPU for NCCL, time
budget spent) is recorded as "skipped" with the reason, never a crash. OUT/report.json is
rewritten before and after every run (a kill leaves what ran), OUT/gpu-check.log holds every
command and its output, OUT/timeline.json the trace; scratch files live in a temp dir. Exit
code: 0 nothing failed, 1 something failed, 2 no GPU (one line, at once) or bad usage.

Runs on a bare GPU machine: stdlib only here; mpitrain is imported from this source tree,
uninstalled (PYTHONPATH; mpitrain/__init__.py maps kernels/ to mpitrain.kernels as setup.py
does); MPI is mpiexec on PATH, else next to python, else an mpich wheel put in .whl/ (installed
offline into the temp dir, for a machine without network). README.md "GPU check" has the recipe.
"""
import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
STEPS = ("nvidia-smi", "kernels", "train", "tests-1", "tests-2", "memcpy", "step", "allreduce",
         "timeline", "gpt")
MODELS = ("mlp", "lenet", "cifar_cnn", "resnet20")
FLAVOURS = ("cupy", "numba")
TOL = dict(rtol=1e-3, atol=1e-5)      # float32 rounding over 3 steps, as tests/gpu
# the GPU-sized GPT of the gpt step (benchmarks/gpt_step.py flags)
GPT_CONFIG = ("--batch", "64", "--block-size", "256", "--n-layer", "6", "--n-head", "6",
              "--n-embd", "384", "--vocab", "65")
KERNEL_TESTS = "tests/gpu/test_gpu_kernels.py"


class CheckFailed(Exception):
    """A run exited 0 but its result is wrong (parameters differ, ...)."""


@dataclass
class Run:
    name: str
    argv: list
    timeout: float                       # killed after this: failed
    env: dict = field(default_factory=dict)
    check: Optional[Callable] = None     # check() -> results dict; raises CheckFailed/SkipRun
    skip: Optional[str] = None
    capture: Optional[str] = None        # stdout to this file (then copied to the log)
    expect: Optional[float] = None       # its usual seconds, if well below timeout: it starts
                                         # only when this (else timeout) fits the budget left


@dataclass
class Step:
    name: str
    runs: list = field(default_factory=list)
    skip: Optional[str] = None


# --- the machine -------------------------------------------------------------------------------

def detect_gpus(smi="nvidia-smi"):
    """(GPU lines of nvidia-smi -L, None) or ([], why there is none)."""
    path = shutil.which(smi)
    if path is None:
        return [], "nvidia-smi not found"
    try:
        res = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi -L: {exc}"
    gpus = [line.strip() for line in res.stdout.splitlines() if line.startswith("GPU ")]
    if res.returncode != 0 or not gpus:
        text = " ".join((res.stderr or res.stdout).split())[:200] or f"exit {res.returncode}"
        return [], f"no CUDA device (nvidia-smi -L: {text})"
    return gpus, None


def mpi_works(mpiexec, env, python):
    """None if `mpiexec -n 2 python` gives two ranks of one world, else why not."""
    code = "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2, 'ranks are singletons'"
    try:
        res = subprocess.run([mpiexec, "-n", "2", python, "-c", code], env=env, timeout=90,
                             capture_output=True, text=True, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{mpiexec}: {exc}"
    if res.returncode == 0:
        return None
    return f"{mpiexec} -n 2: " + " ".join(res.stderr.split()[-30:])


def find_mpiexec(env, work, python, explicit=None, wheels=None):
    """(mpiexec, source, tried): the first launcher that runs a 2-rank mpi4py world.

    An explicit one (--mpiexec / $MPIEXEC) is the only one tried. Otherwise: mpiexec on PATH,
    next to python, then an mpich wheel from .whl/ installed offline with pip --prefix into `work`
    (pip --target drops the wheel's lib/ with libmpi), whose bin/ and lib/ join PATH and
    LD_LIBRARY_PATH in `env` (mpi4py finds libmpi there)."""
    tried = []

    def candidates():
        if explicit:
            yield "--mpiexec/$MPIEXEC", explicit
            return
        near = os.path.join(os.path.dirname(python), "mpiexec")
        yield "PATH", shutil.which("mpiexec", path=env.get("PATH"))
        yield "next to python", near if os.access(near, os.X_OK) else None
        found = sorted(glob.glob(str(REPO / ".whl" / "mpich-*.whl"))) if wheels is None else wheels
        if not found:
            tried.append("no mpich wheel in .whl/ (README.md: GPU check)")
            return
        prefix = os.path.join(work, "mpich")
        res = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                              "--no-compile", "--no-cache-dir", "--ignore-installed", "--prefix",
                              prefix, found[-1]], capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            tried.append(f"pip install {found[-1]}: " + " ".join(res.stderr.split()[-30:]))
            return
        env["PATH"] = os.path.join(prefix, "bin") + os.pathsep + env.get("PATH", "")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (os.path.join(prefix, "lib"), env.get("LD_LIBRARY_PATH")) if p)
        yield f"carried wheel {os.path.basename(found[-1])}", os.path.join(prefix, "bin", "mpiexec")

    for source, path in candidates():
        if path:
            why = mpi_works(path, env, python)
            if why is None:
                return path, source, tried
            tried.append(why)
    return None, None, tried


PROBE = r"""
import json, sys
facts = {"flavours": {}}
def why(exc):
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
try:
    from mpi4py import MPI
    facts["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
    import mpitrain
    from mpitrain import kernels
    from mpitrain.comm import device
    facts["mpitrain"] = mpitrain.__file__
except Exception as exc:
    facts["blocker"] = why(exc)
    print(json.dumps(facts)); sys.exit()
from importlib.metadata import version
facts["versions"] = {}
for name in ("numpy", "numba", "numba-cuda", "cupy-cuda12x", "cupy-cuda13x", "torch", "mpi4py",
             "mpich", "pytest"):
    try:
        facts["versions"][name] = version(name)
    except Exception:
        pass
def double_numba(x, y):           # a global `cuda`: the simulator swaps it for its own
    i = cuda.grid(1)
    if i < x.size:
        y[i] = x[i] + x[i]
def double(flavour):
    # compile (CuPy: NVRTC; Numba: NVVM) and run one kernel on 4 elements: y = 2 x
    import numpy as np
    x = np.arange(4, dtype=np.float32)
    if flavour == "cupy":
        k = cupy.ElementwiseKernel("float32 x", "float32 y", "y = x + x", "gpu_check_double")
        y = cupy.empty(4, dtype="float32")
        k(cupy.asarray(x), y)
        return cupy.asnumpy(y).tolist()
    dx = cuda.to_device(x)
    dy = cuda.device_array_like(dx)
    cuda.jit(double_numba)[1, 4](dx, dy)
    return dy.copy_to_host().tolist()
for flavour in ("cupy", "numba"):
    try:
        if flavour == "cupy":
            import cupy
        else:
            from numba import cuda
        device.select_device(0, flavour=flavour)
        kernels.get("cuda", flavour)
    except Exception as exc:
        facts["flavours"][flavour] = why(exc)
        continue
    try:
        got = double(flavour)
        if got != [0.0, 2.0, 4.0, 6.0]:
            raise RuntimeError(f"gave {got} for [0, 2, 4, 6]")
        facts["flavours"][flavour] = None
    except Exception as exc:
        facts["flavours"][flavour] = f"a 4-element test kernel failed: {why(exc)}"
try:
    import torch
    facts["torch"] = None if torch.cuda.is_available() else "torch.cuda.is_available() is False"
except Exception as exc:
    facts["torch"] = why(exc)
try:
    from cupy.cuda import nccl
    facts["nccl"] = None
    facts["nccl_version"] = nccl.get_version()
except Exception as exc:
    facts["nccl"] = why(exc)
print(json.dumps(facts))
"""


def probe(env, python):
    """What the step plan depends on, asked of `python` in a child (no CUDA context here)."""
    try:
        res = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True,
                             timeout=300, cwd=tempfile.gettempdir())
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"blocker": f"probe failed: {exc}", "flavours": {}}


# --- the plan ----------------------------------------------------------------------------------

class Plan:
    """What every step planner needs: the facts, the options and the derived skip reasons."""

    def __init__(self, facts, opts, work, out):
        self.facts, self.opts, self.quick, self.out = facts, opts, opts.quick, out
        self.py, self.repo, self.work = facts["python"], str(REPO), work
        self.mpiexec = facts.get("mpiexec")
        self.no_mpi = None if self.mpiexec else "no mpiexec that runs 2 ranks (" + "; ".join(
            facts.get("mpiexec_tried") or ["none found"]) + ")"
        why = {f: facts["flavours"].get(f, "not probed") for f in opts.flavours}
        self.flavours = [f for f in opts.flavours if why[f] is None]       # usable here
        self.not_usable = {f: w for f, w in why.items() if w is not None}
        self.no_flavour = None if self.flavours else "no usable CUDA kernel flavour (" + \
            "; ".join(f"{f}: {w}" for f, w in self.not_usable.items()) + ")"
        # pytest -k for tests/gpu (flavour in the test ids): the usable flavours, if not all
        self.usable_k = " or ".join(self.flavours) if len(self.flavours) < len(FLAVOURS) else None
        self.torch = facts.get("torch", "not probed")                     # None: usable
        self.pytest = [self.py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                       f"{self.repo}/pytest.ini", "--rootdir", self.repo, "-m", "gpu", "-rfEs"]
        self.gpu_tests = [f"{self.repo}/tests/gpu", f"--ignore={self.repo}/{KERNEL_TESTS}"]

    def w(self, name):
        """A scratch file."""
        return os.path.join(self.work, name)

    def script(self, name):
        return [self.py, f"{self.repo}/benchmarks/{name}"]

    def train_args(self, model, steps="3", samples="64", batch="8"):
        return ["-m", "mpitrain", "--model", model, "--dataset", "synthetic",
                "--synthetic-samples", samples, "--steps", steps, "--batch-size", batch,
                "--lr", "0.05", "--no-progress"]


def plan_nvidia_smi(p):
    query = ("index,name,driver_version,memory.total,compute_cap,clocks.max.sm,"
             "clocks.max.memory,pcie.link.gen.max,pcie.link.width.max,power.limit")
    yield Run("nvidia-smi", ["nvidia-smi"], 60)
    yield Run("query", ["nvidia-smi", "--format=csv", f"--query-gpu={query}"], 60,
              capture=p.w("nvidia-smi.csv"), check=lambda: csv_rows(p.w("nvidia-smi.csv")))


def plan_kernels(p):
    # a flavour that loads but cannot compile a kernel would fail every test: left out
    only = ["-k", p.usable_k] if p.usable_k else []
    xml = p.w("kernels.xml")
    yield Run("pytest", p.pytest + [f"{p.repo}/{KERNEL_TESTS}"] + only + [f"--junitxml={xml}"],
              150 if p.quick else 240, check=lambda: junit(xml, by_flavour=True))
    for f, why in p.not_usable.items():
        yield Run(f, [], 0, skip=f"{f} flavour unusable: {why}")


def plan_train(p):
    for model in p.opts.models or (("lenet",) if p.quick else MODELS):
        args = [p.py] + p.train_args(model) + p.opts.train_args
        ref = p.w(f"train-{model}-cpu.npz")
        yield Run(f"{model} cpu", args + ["--device", "cpu", "--save", ref], 180, expect=30)
        for f in p.opts.flavours:
            got = p.w(f"train-{model}-{f}.npz")
            yield Run(f"{model} cuda-{f}", args + [
                "--device", "cuda", "--kernels", f, "--save", got], 180, expect=30,
                check=lambda got=got, ref=ref: compare_npz(got, ref),
                skip=p.not_usable.get(f))


def plan_tests_1(p):
    # the CLI test's 2-rank case needs mpiexec; --quick leaves the CLI comparison to `train`
    terms = ([f"({p.usable_k})"] if p.usable_k else []) + (
        ["not test_cli_matches_cpu"] if p.quick else
        [] if p.mpiexec else ["not (test_cli_matches_cpu and 2])"])
    select = ["-k", " and ".join(terms)] if terms else []
    xml = p.w("tests-1.xml")
    yield Run("pytest", p.pytest + p.gpu_tests + select + [f"--junitxml={xml}"],
              150 if p.quick else 300, expect=60 if p.quick else 120, check=lambda: junit(xml))


def plan_tests_2(p):
    prefix = p.w("tests-2")
    per_rank = ("import os, sys, pytest; r = os.environ.get('PMI_RANK') or "   # a file per rank
                "os.environ.get('OMPI_COMM_WORLD_RANK', '0'); sys.exit(pytest.main(sys.argv[1:] "
                f"+ ['--junitxml={prefix}-' + r + '.xml']))")
    argv = [p.mpiexec, "-n", "2", p.py, "-c", per_rank] + p.pytest[3:] + p.gpu_tests + (
        ["-k", p.usable_k] if p.usable_k else [])
    yield Run("mpiexec -n 2 pytest", argv, 150 if p.quick else 300,
              expect=60 if p.quick else 120, check=lambda: junit_ranks(prefix))


def plan_memcpy(p):
    path = p.w("gpu_kernels.json")
    sizes = ["--elements", str(1 << 24), "--gemm", "2048", "--rounds", "3"] if p.quick else []
    yield Run("gpu_kernels.py", p.script("gpu_kernels.py") + [
        "--kernels", *p.flavours, "--json", path] + sizes, 180, expect=30,
        check=lambda: read_json(path))


def plan_step(p):
    for i, f in enumerate(p.flavours):
        for batch in (64,) if p.quick else (64, 256):
            path = p.w(f"step-{f}-{batch}.json")
            torch = ["--torch"] if i == 0 and p.torch is None else []   # once per batch
            yield Run(f"{f} batch {batch}" + (" +torch" if torch else ""), p.script("step.py") + [
                "--device", "cuda", "--kernels", f, "--model", *(p.opts.models or MODELS),
                "--batch", str(batch), "--json", path] + torch +
                (["--rounds", "2", "--steps", "5", "--warmup", "2"] if p.quick else []), 240,
                expect=60 if p.quick else 120, check=lambda path=path: step_summary(path))
    if p.flavours and p.torch is not None:
        yield Run("torch", [], 0, skip=f"no PyTorch CUDA: {p.torch}")


def plan_gpt(p):
    # PyTorch in every flavour's run: the ratio is taken within each round, under the same load
    for f in p.flavours:
        path = p.w(f"gpt-{f}.json")
        torch = [] if p.torch is None else ["--no-torch"]
        yield Run(f + ("" if torch else " +torch"), p.script("gpt_step.py") + [
            "--device", "cuda", "--kernels", f, *GPT_CONFIG, "--json", path] + torch +
            (["--rounds", "2", "--steps", "5", "--warmup", "2"] if p.quick else
             ["--rounds", "3", "--steps", "10"]), 240, expect=45 if p.quick else 90,
            check=lambda path=path: gpt_summary(path))
    if p.flavours and p.torch is not None:
        yield Run("torch", [], 0, skip=f"no PyTorch CUDA: {p.torch}")


def plan_allreduce(p):
    bench = p.script("allreduce_device.py") + [
        "--kernels", "cupy" if "cupy" in p.flavours else (p.flavours or ["numba"])[0]] + (
        ["--max-bytes", "16M", "--iters", "5"] if p.quick else [])
    gpus = p.facts.get("gpu_count", 0)
    nccl = (f"{gpus} GPU: NCCL needs one rank per GPU and refuses two ranks on one GPU"
            if gpus < 2 else p.facts.get("nccl"))
    shared = [(t, 2, "shared GPU", None) for t in (("host",) if p.quick else ("host", "mpi"))]
    for transport, ranks, where, skip in shared + [("nccl", gpus, "one per GPU", nccl)]:
        path = p.w(f"allreduce-{transport}.json")
        yield Run(f"{transport} {ranks} ranks, {where}", [p.mpiexec, "-n", str(ranks)] + bench + [
            "--json", path], 240, expect=30, env={"MPITRAIN_DEVICE_COMM": transport},
            check=lambda path=path: read_json(path), skip=skip)


def plan_timeline(p):
    trace = os.path.join(p.out, "timeline.json")
    flavour = (p.flavours or ["cupy"])[0]
    train = [p.mpiexec, "-n", "2", p.py] + p.train_args(
        "lenet", steps="10" if p.quick else "30", samples="1024", batch="32") + [
        "--device", "cuda", "--kernels", flavour, "--timeline", trace]
    yield Run("2-rank training", train, 240, expect=45)
    yield Run("summary", [p.py, "-m", "mpitrain.timeline", trace], 60)


PLANNERS = dict(zip(STEPS, (plan_nvidia_smi, plan_kernels, plan_train, plan_tests_1,
                            plan_tests_2, plan_memcpy, plan_step, plan_allreduce, plan_timeline,
                            plan_gpt)))
MULTI_RANK = ("tests-2", "allreduce", "timeline")


def plan(facts, opts, work, out):
    """The steps, as commands and skip reasons: a function of the facts only (tested)."""
    p = Plan(facts, opts, work, out)
    steps = [Step(name, list(PLANNERS[name](p))) for name in STEPS]
    for s in steps:
        if s.name not in opts.only or s.name in opts.skip_steps:
            s.skip = "not selected (--only/--skip)"
        elif s.name == "nvidia-smi":
            continue
        elif facts.get("blocker"):
            s.skip = f"python cannot import mpi4py's MPI or mpitrain: {facts['blocker']}"
        else:       # every other step needs a CUDA kernel flavour, these three 2 MPI ranks too
            s.skip = p.no_flavour or (p.no_mpi if s.name in MULTI_RANK else None)
    return steps


# --- what a run's files say --------------------------------------------------------------------

def read_json(path):
    with open(path) as f:
        doc = json.load(f)
    if isinstance(doc, dict) and "skipped" in doc:
        raise SkipRun(doc["skipped"])
    return doc


class SkipRun(Exception):
    """The run found its own prerequisite missing (e.g. a transport that is not available)."""


def csv_rows(path):
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip()]
    keys = [k.strip() for k in lines[0].split(",")]
    return [dict(zip(keys, (v.strip() for v in line.split(",")))) for line in lines[1:]]


def junit(path, by_flavour=False):
    """Counts, failing test ids and skip reasons of a pytest --junitxml file (by_flavour: also
    per kernel flavour, from the test ids); CheckFailed if one failed, SkipRun if all skipped."""
    def empty():
        return {"passed": 0, "failed": [], "skipped": 0}
    out, groups, reasons = empty(), {}, []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        buckets = [out] + [groups.setdefault(f, empty()) for f in FLAVOURS
                           if by_flavour and f in name]
        for b in buckets:
            if failed is not None:
                b["failed"].append(name)
            elif skipped is not None:
                b["skipped"] += 1
            else:
                b["passed"] += 1
        if skipped is not None and skipped.get("message") not in reasons:
            reasons.append(skipped.get("message"))
    out["skip_reasons"] = reasons[:10]
    if by_flavour:
        out["by_flavour"] = groups
    if out["failed"]:
        raise CheckFailed(f"{len(out['failed'])} failed: {', '.join(out['failed'][:8])}", out)
    if not out["passed"] and out["skipped"]:
        raise SkipRun(f"all {out['skipped']} tests skipped ({'; '.join(reasons[:3])})", out)
    return out


def junit_ranks(prefix):
    ranks = {}
    for path in sorted(glob.glob(prefix + "-*.xml")):
        ranks[f"rank {path[len(prefix) + 1:-4]}"] = junit(path)
    if not ranks:
        raise CheckFailed("no rank wrote its junit file")
    return ranks


def compare_npz(got_path, want_path, rtol=TOL["rtol"], atol=TOL["atol"]):
    """Parameters of a cuda run against the cpu run: max errors per name; CheckFailed if off."""
    import numpy as np
    if not os.path.exists(want_path):
        raise CheckFailed(f"no CPU reference ({os.path.basename(want_path)} was not written)")
    with np.load(got_path) as g, np.load(want_path) as w:
        if sorted(g.files) != sorted(w.files):
            raise CheckFailed(f"parameter names differ: {sorted(g.files)} vs {sorted(w.files)}")
        errs, bad = {}, []
        for name in w.files:
            a, b = g[name].astype(np.float64), w[name].astype(np.float64)
            if a.shape != b.shape:
                bad.append(f"{name} shape {a.shape} vs {b.shape}")
                continue
            err = float(np.max(np.abs(a - b))) if a.size else 0.0
            errs[name] = err
            if not np.allclose(a, b, rtol=rtol, atol=atol) or not np.all(np.isfinite(a)):
                bad.append(f"{name} max abs err {err:.3g}")
    result = {"max_abs_err": errs, "rtol": rtol, "atol": atol}
    if bad:
        raise CheckFailed("parameters differ from the CPU run: " + "; ".join(bad[:6]), result)
    return result


def step_summary(path):
    doc = read_json(path)
    return {r["model"]: {k: r.get(k) for k in ("batch", "kernels", "blas_gflops", "torch_step_ms")}
            | {"step_ms": r["best"]["step_ms"], "gflops": r["best"]["gflops"]}
            for r in doc["results"]}


def gpt_summary(path, rtol=TOL["rtol"]):
    """benchmarks/gpt_step.py's JSON (per-round times left out); CheckFailed if ours and
    PyTorch's first-batch losses (same weights, same batch) differ by more than ``rtol``."""
    doc = read_json(path)
    out = {k: v for k, v in doc.items() if k != "rounds"}
    if "torch_loss" in doc:
        diff = abs(doc["ours_loss"] - doc["torch_loss"])
        out["loss_rel_diff"] = diff / max(abs(doc["torch_loss"]), 1e-30)
        if not diff <= rtol * abs(doc["torch_loss"]):
            raise CheckFailed(f"first-batch loss: ours {doc['ours_loss']:.6f}, PyTorch "
                              f"{doc['torch_loss']:.6f} (rtol {rtol})", out)
    return out


# --- running it --------------------------------------------------------------------------------

class Report:
    """report.json + gpu-check.log, rewritten (atomically) whenever anything changes."""

    def __init__(self, out, header):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path, self.log_path = self.out / "report.json", self.out / "gpu-check.log"
        open(self.log_path, "w").close()
        self.log = open(self.log_path, "a")     # O_APPEND: the children's output lands at the end
        self.doc = dict(header, started=now(), finished=None, steps=[], summary={})

    def write(self):
        self.doc["summary"] = dict(Counter(s["status"] for s in self.doc["steps"]))
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)

    def note(self, text):
        self.log.write(text + "\n")
        self.log.flush()


def now():
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def execute(run, env, log, cwd, timeout):
    """Run one command, output appended to the log; returns (rc or None on timeout, seconds)."""
    start = time.monotonic()
    stdout = open(run.capture, "w") if run.capture else log
    try:
        proc = subprocess.Popen(run.argv, env={**env, **run.env}, cwd=cwd, stdout=stdout,
                                stderr=log, start_new_session=True)
    except OSError as exc:
        log.write(f"cannot start: {exc}\n")
        return 127, time.monotonic() - start
    finally:
        if run.capture:
            stdout.close()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    except BaseException:                         # interrupted: take the whole job down with us
        kill_group(proc)
        raise
    if rc is None:
        kill_group(proc)
    if run.capture:
        with open(run.capture) as f:
            log.write(f.read())
    return rc, time.monotonic() - start


def kill_group(proc):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=5)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def command(run):
    """The run as one shell line (for the report and the log)."""
    env = " ".join(f"{k}={v}" for k, v in run.env.items())
    return (env + " " if env else "") + shlex.join(str(a) for a in run.argv)


def tail(path, offset, limit=3000):
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()[-limit:]


def run_steps(steps, report, env, cwd, deadline):
    """Execute the plan; each run's record (status, seconds, rc, results or reason) goes into
    the report, which is written before and after every run.

    A run starts only if what it needs (Run.expect, else its timeout) fits in the time left
    before `deadline`; else it is skipped. One that the deadline cuts off is skipped too; one
    killed by its own timeout failed."""
    records = [dict(name=s.name, status="pending", runs=[dict(name=r.name, cmd=command(r),
                                                              status="pending") for r in s.runs])
               for s in steps]
    report.doc["steps"] = records
    report.write()
    for step, rec in zip(steps, records):
        if step.skip:
            rec.update(status="skipped", reason=step.skip)
            for r in rec["runs"]:
                r.update(status="skipped", reason=step.skip)
            report.write()
            print(f"gpu-check: {step.name}: skipped: {step.skip}", flush=True)
            continue
        rec["status"] = "running"
        started = time.monotonic()
        for run, rr in zip(step.runs, rec["runs"]):
            left = deadline - time.monotonic()
            need = run.expect or run.timeout
            if run.skip or need > left:
                rr.update(status="skipped", reason=run.skip or (
                    f"time budget spent: needs {need:.0f} s, {max(left, 0):.0f} s left"))
                report.write()
                continue
            rr.update(status="running", started=now())
            report.write()
            report.note(f"\n== {step.name} / {run.name}: {command(run)}")
            offset = report.log.tell()
            rc, secs = execute(run, env, report.log, cwd, min(run.timeout, left))
            report.log.flush()
            rr.update(rc=rc, seconds=round(secs, 1))
            if rc is None and left < run.timeout:
                rr.update(status="skipped", reason=f"time budget spent: cut off after {secs:.0f} "
                          f"s (its timeout: {run.timeout:.0f} s)")
            elif rc is None:
                rr.update(status="failed", reason=f"timeout after {secs:.0f} s")
            elif rc != 0:
                rr.update(status="failed", reason=f"exit code {rc}")
            else:
                rr["status"] = "passed"
                if run.check:
                    try:
                        rr["results"] = run.check()
                    except (CheckFailed, SkipRun) as exc:
                        rr.update(status="failed" if isinstance(exc, CheckFailed) else "skipped",
                                  reason=exc.args[0])
                        if len(exc.args) > 1:
                            rr["results"] = exc.args[1]
                    except (OSError, ValueError, KeyError, ET.ParseError) as exc:
                        rr.update(status="failed", reason=f"unreadable result: {exc}")
            if rr["status"] == "failed":
                rr["tail"] = tail(report.log_path, offset)
            report.note(f"== {step.name} / {run.name}: {rr['status']} ({secs:.1f} s)"
                        + (f": {rr['reason']}" if rr.get("reason") else ""))
            report.write()
        states = [r["status"] for r in rec["runs"]]
        rec["status"] = ("failed" if "failed" in states else "passed" if "passed" in states
                         else "skipped")
        if rec["status"] == "skipped":
            rec["reason"] = "; ".join(sorted({r.get("reason", "") for r in rec["runs"]}))
        rec["seconds"] = round(time.monotonic() - started, 1)
        report.write()
        print(f"gpu-check: {step.name}: {rec['status']} ({rec['seconds']} s)", flush=True)
    return records


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="about 3 minutes: lenet only, fewer rounds and sizes")
    ap.add_argument("--out", default="out/gpu-check", help="report.json, gpu-check.log, "
                    "timeline.json (default out/gpu-check)")
    ap.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS), metavar="STEP",
                    help=f"run these steps only ({', '.join(STEPS)})")
    ap.add_argument("--skip", nargs="+", choices=STEPS, default=[], dest="skip_steps",
                    metavar="STEP", help="leave these steps out")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=None,
                    help="zoo models for train and step (default all; --quick: lenet in train)")
    ap.add_argument("--flavours", nargs="+", choices=FLAVOURS, default=list(FLAVOURS))
    ap.add_argument("--train-args", default="",
                    help="extra flags for the train step's runs (e.g. '--hidden 8')")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole check (default 540, --quick 180); runs that "
                         "would start later are skipped")
    ap.add_argument("--mpiexec", default=os.environ.get("MPIEXEC") or None,
                    help="MPI launcher (default: $MPIEXEC, mpiexec on PATH, next to python, "
                         "else the mpich wheel in .whl/)")
    ap.add_argument("--mpich-wheel", default=None,
                    help="mpich wheel to install offline when no mpiexec works "
                         "(default: the newest .whl/mpich-*.whl)")
    ap.add_argument("--dry-run", action="store_true",
                    help="prepare and plan, write the report with every command, run nothing")
    args = ap.parse_args(argv)
    args.train_args = args.train_args.split()
    if args.budget is None:
        args.budget = 180.0 if args.quick else 540.0
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.monotonic()
    gpus, why = detect_gpus()
    if not gpus:
        print(f"gpu-check: no GPU found ({why})", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    work = tempfile.mkdtemp(prefix="gpu-check-")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # mpitrain from this tree, uninstalled (mpitrain/__init__.py maps kernels/ to mpitrain.kernels)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # one writable Numba cache for every run: kernels compiled by an earlier step (kernels,
    # train) are loaded, not compiled again, by the timed ones (step, ...)
    env.setdefault("NUMBA_CACHE_DIR", os.path.join(work, "numba-cache"))
    python = sys.executable
    # also for 1-rank steps: importing mpitrain loads libmpi, which the .whl/ wheel may bring
    mpiexec, source, tried = find_mpiexec(env, work, python, explicit=args.mpiexec,
                                          wheels=[args.mpich_wheel] if args.mpich_wheel else None)
    if mpiexec:
        env["MPIEXEC"] = mpiexec              # tests/gpu launch mpiexec themselves
    facts = dict(probe(env, python), python=python, gpus=gpus, gpu_count=len(gpus),
                 mpiexec=mpiexec, mpiexec_source=source, mpiexec_tried=tried)
    steps = plan(facts, args, work, out)
    report = Report(out, dict(command=[python] + sys.argv, quick=args.quick,
                              budget_s=args.budget, facts=facts, work_dir=work,
                              numba_cache_dir=env["NUMBA_CACHE_DIR"]))
    print(f"gpu-check: {len(gpus)} GPU ({gpus[0]}); mpiexec: {mpiexec or 'none'}"
          f"{f' ({source})' if source else ''}; report: {report.path}", flush=True)
    for f in args.flavours:
        if facts["flavours"].get(f):
            print(f"gpu-check: {f} flavour unusable: {facts['flavours'][f]}", flush=True)
    report.note("gpu-check facts: " + json.dumps(facts, indent=1))
    if args.dry_run:
        report.doc["steps"] = [dict(name=s.name, status="skipped" if s.skip else "planned",
                                    reason=s.skip, runs=[dict(name=r.name, cmd=command(r),
                                                              timeout_s=r.timeout,
                                                              expect_s=r.expect, skip=r.skip)
                                                         for r in s.runs])
                               for s in steps]
        report.write()
        report.log.close()
        shutil.rmtree(work, ignore_errors=True)
        for s in report.doc["steps"]:
            print(f"  {s['status']:8} {s['name']:11} {s['reason'] or ''}")
        return 0
    try:
        records = run_steps(steps, report, env, work, start + args.budget)
    except KeyboardInterrupt:
        report.doc["interrupted"] = now()
        report.write()
        print("gpu-check: interrupted; partial report written", file=sys.stderr)
        return 1
    finally:
        report.doc["finished"] = now()
        report.doc["seconds"] = round(time.monotonic() - start, 1)
        report.write()
        report.log.close()
        shutil.rmtree(work, ignore_errors=True)
    counts = report.doc["summary"]
    print(f"gpu-check: {', '.join(f'{n} {s}' for s, n in sorted(counts.items()))} in "
          f"{time.monotonic() - start:.0f} s; {report.path}, {report.log_path}")
    for rec in records:
        for r in rec["runs"]:
            if r["status"] == "failed":
                print(f"  failed: {rec['name']} / {r['name']}: {r.get('reason')}")
    return 1 if counts.get("failed") else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)    # a kill still writes the report
    sys.exit(main())
