"""benchmarks/gpt_step.py --device cuda on the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1).

The GPU comparison of `make gpu-check`'s gpt step, at a tiny configuration: the script runs the
GPT on the Numba CUDA flavour (and on the CuPy flavour with its CUDA C compiled for the host,
tests/support/fake_cupy.py), writes the JSON that tools/gpu_check.py reads (its summary is taken
from the file here too), and stops with one line and exit code 2 when the PyTorch comparison or
the kernel flavour it was asked for is not there.
"""
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "benchmarks" / "gpt_step.py"
TINY = ["--batch", "2", "--block-size", "8", "--n-layer", "1", "--n-head", "2", "--n-embd", "8",
        "--vocab", "11", "--steps", "1", "--rounds", "1", "--warmup", "0"]


# CuPy as tests/support/fake_cupy.py emulates it, one device
FAKE_CUPY = """
import sys, types
from tests.support import fake_cupy
cp = fake_cupy.module()
cp.cuda.Device = lambda i: types.SimpleNamespace(use=lambda: None)
sys.modules["cupy"] = cp
"""


def gpt_step(tmp_path, *args, **env):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=170)


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpt_step_on_the_numba_flavour_writes_its_json(tmp_path, dev):
    path = tmp_path / "gpt.json"
    res = gpt_step(tmp_path, "--device", "cuda", "--kernels", "numba", "--no-torch", *TINY,
                   "--json", str(path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "GPT 1x8 h2 T8 B2 V11, cuda-numba: ours " in res.stdout
    doc = json.loads(path.read_text())
    assert doc["config"] == dict(batch=2, block_size=8, n_layer=1, n_head=2, n_embd=8, vocab=11,
                                 dtype="float32", threads=1, device="cuda", kernels="cuda-numba")
    # random weights, uniform-ish logits: about ln(vocab) on the first batch
    assert abs(doc["ours_loss"] - math.log(11)) < 0.5
    assert len(doc["rounds"]) == 1 and doc["ours_ms"] > 0 and doc["tokens_per_s"] > 0
    assert "torch_ms" not in doc
    summary = gpu_check().gpt_summary(str(path))            # what the report records
    assert summary["ours_ms"] == doc["ours_ms"] and "rounds" not in summary


def test_gpt_step_on_the_emulated_cupy_flavour(tmp_path):
    from tests.support import fake_cupy
    if not fake_cupy.compiler_available():
        pytest.skip("no host C++ compiler (g++) to run the CuPy kernel sources")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "cupy.py").write_text(FAKE_CUPY)
    path = tmp_path / "gpt.json"
    res = gpt_step(tmp_path, "--device", "cuda", "--kernels", "cupy", "--no-torch", *TINY,
                   "--json", str(path), PYTHONPATH=os.pathsep.join([str(stub), str(ROOT)]))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads(path.read_text())
    assert (doc["config"]["device"], doc["config"]["kernels"]) == ("cuda", "cuda-cupy")
    assert abs(doc["ours_loss"] - math.log(11)) < 0.5


def test_the_pytorch_comparison_needs_torch_to_see_the_gpu(tmp_path, dev):
    """Without --no-torch: a torch that sees no GPU is one line and exit 2 before anything is
    timed; one that sees it (on a GPU) gives the comparison, with the same first-batch loss."""
    path = tmp_path / "gpt.json"
    res = gpt_step(tmp_path, "--device", "cuda", "--kernels", "numba", *TINY, "--json",
                   str(path))
    if res.returncode == 2:
        [line] = res.stderr.splitlines()
        assert line.startswith("gpt_step: error: ")
        assert ("torch.cuda.is_available() is False" in line
                or "needs torch, which is not installed" in line), line
        assert res.stdout == "" and not path.exists()
    else:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        doc = json.loads(path.read_text())
        assert doc["torch_device"] == "cuda" and doc["torch_tf32"] is False
        assert gpu_check().gpt_summary(str(path))["loss_rel_diff"] < 1e-3


def test_a_flavour_that_cannot_load_is_one_line_and_exit_2(tmp_path):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    path = tmp_path / "gpt.json"
    res = gpt_step(tmp_path, "--device", "cuda", "--kernels", "cupy", "--no-torch", *TINY,
                   "--json", str(path))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "gpt_step: error: --kernels cupy needs CuPy (No module named 'cupy'); install it with "
        "pip install -e '.[cuda]' or use --kernels numba"]
    assert res.stdout == "" and not path.exists()
