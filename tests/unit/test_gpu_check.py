"""tools/gpu_check.py (`make gpu-check`) on the CPU: no-GPU exit, plan, runner, checks.

The GPU itself is faked (an nvidia-smi script on PATH) or left out: what is tested is that the
check stops at once without a GPU, turns every missing prerequisite into "skipped: reason",
records each run (also a timeout or a wrong result) and rewrites the report as it goes.
"""
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)

FAKE_SMI = """#!/bin/sh
if [ "$1" = "-L" ]; then echo "GPU 0: Fake H100 (UUID: GPU-0)"; exit 0; fi
echo "fake nvidia-smi $*"
"""


def fake_smi(tmp_path, text=FAKE_SMI):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(text)
    smi.chmod(0o755)
    return bin_dir


def run_script(args, path, tmp_path, **env):
    return subprocess.run([sys.executable, str(SCRIPT)] + args, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(os.environ, PATH=str(path), **env))


# --- no GPU ------------------------------------------------------------------------------------

def test_no_nvidia_smi_is_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = run_script(["--out", str(tmp_path / "out")], empty, tmp_path)
    assert res.returncode == 2
    assert res.stderr.splitlines() == ["gpu-check: no GPU found (nvidia-smi not found)"]
    assert res.stdout == ""
    assert not (tmp_path / "out").exists()


def test_nvidia_smi_without_a_device_is_exit_2(tmp_path):
    bin_dir = fake_smi(tmp_path, "#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\n"
                                 "exit 9\n")
    res = run_script([], bin_dir, tmp_path)
    assert res.returncode == 2
    [line] = res.stderr.splitlines()
    assert line == ("gpu-check: no GPU found (no CUDA device (nvidia-smi -L: NVIDIA-SMI has "
                    "failed: no driver))")


def test_make_gpu_check_without_gpu_stops_at_once(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make")
    empty = tmp_path / "empty"
    empty.mkdir()
    res = subprocess.run([make, "-s", "-C", str(ROOT), "gpu-check", f"PYTHON={sys.executable}",
                          f"GPU_PYTHON={sys.executable}", "ARGS=--out " + str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PATH=str(empty)))
    assert res.returncode == 2
    assert "gpu-check: no GPU found (nvidia-smi not found)" in res.stderr.splitlines()


# --- the plan ----------------------------------------------------------------------------------

def facts(**over):
    base = dict(python="py", gpu_count=1, mpiexec="/x/mpiexec", mpiexec_tried=[],
                flavours={"cupy": None, "numba": None}, torch=None, nccl=None)
    base.update(over)
    return base


def opts(*argv):
    return gc.parse_args(list(argv))


def steps_of(f, *argv):
    return {s.name: s for s in gc.plan(f, opts(*argv), "/w", "/o")}


def runs_of(step):
    return {r.name: r for r in step.runs}


def test_full_plan_with_everything_on_one_gpu():
    steps = steps_of(facts())
    assert list(steps) == list(gc.STEPS)
    assert all(s.skip is None for s in steps.values())
    train = runs_of(steps["train"])
    assert set(train) == {f"{m} {d}" for m in gc.MODELS for d in ("cpu", "cuda-cupy",
                                                                   "cuda-numba")}
    assert not any(r.skip for r in train.values())
    step = runs_of(steps["step"])
    assert set(step) == {"cupy batch 64 +torch", "cupy batch 256 +torch", "numba batch 64",
                         "numba batch 256"}
    assert "--torch" in step["cupy batch 64 +torch"].argv
    assert set(runs_of(steps["gpt"])) == {"cupy +torch", "numba +torch"}
    ar = runs_of(steps["allreduce"])
    assert ar["host 2 ranks, shared GPU"].env == {"MPITRAIN_DEVICE_COMM": "host"}
    assert ar["mpi 2 ranks, shared GPU"].argv[:3] == ["/x/mpiexec", "-n", "2"]
    assert "one rank per GPU" in ar["nccl 1 ranks, one per GPU"].skip
    tests1 = steps["tests-1"].runs[0].argv
    assert "-k" not in tests1 and f"--ignore={ROOT}/{gc.KERNEL_TESTS}" in tests1


def test_two_gpus_run_nccl_with_one_rank_each():
    nccl = runs_of(steps_of(facts(gpu_count=2))["allreduce"])["nccl 2 ranks, one per GPU"]
    assert nccl.skip is None
    assert nccl.argv[:3] == ["/x/mpiexec", "-n", "2"]
    assert nccl.env == {"MPITRAIN_DEVICE_COMM": "nccl"}
    no_nccl = runs_of(steps_of(facts(gpu_count=2, nccl="ImportError: nccl"))["allreduce"])
    assert no_nccl["nccl 2 ranks, one per GPU"].skip == "ImportError: nccl"


def test_no_mpiexec_skips_the_multi_rank_steps_with_the_reason():
    steps = steps_of(facts(mpiexec=None, mpiexec_tried=["no mpich wheel in .whl/"]))
    for name in ("tests-2", "allreduce", "timeline"):
        assert steps[name].skip.startswith("no mpiexec that runs 2 ranks (no mpich wheel")
    for name in ("kernels", "train", "tests-1", "memcpy", "step", "gpt"):
        assert steps[name].skip is None
    argv = steps["tests-1"].runs[0].argv            # the CLI test's 2-rank case is left out
    assert argv[argv.index("-k") + 1] == "not (test_cli_matches_cpu and 2])"


def test_no_cupy_runs_numba_only_and_says_why():
    steps = steps_of(facts(flavours={"cupy": "ModuleNotFoundError: No module named 'cupy'",
                                     "numba": None}))
    train = runs_of(steps["train"])
    assert "No module named 'cupy'" in train["lenet cuda-cupy"].skip
    assert train["lenet cuda-numba"].skip is None
    assert set(runs_of(steps["step"])) == {"numba batch 64 +torch", "numba batch 256 +torch"}
    assert set(runs_of(steps["gpt"])) == {"numba +torch"}
    host = runs_of(steps["allreduce"])["host 2 ranks, shared GPU"].argv
    assert host[host.index("--kernels") + 1] == "numba"
    memcpy = steps["memcpy"].runs[0].argv
    assert memcpy[memcpy.index("--kernels") + 1:memcpy.index("--json")] == ["numba"]


def test_no_flavour_and_no_torch():
    none = steps_of(facts(flavours={"cupy": "no CuPy", "numba": "no device"}))
    assert none["nvidia-smi"].skip is None
    assert none["train"].skip == "no usable CUDA kernel flavour (cupy: no CuPy; numba: no device)"
    step = runs_of(steps_of(facts(torch="ModuleNotFoundError: torch"))["step"])
    assert step["torch"].skip == "no PyTorch CUDA: ModuleNotFoundError: torch"
    assert not any("--torch" in r.argv for r in step.values())


GPT = ["--batch", "64", "--block-size", "256", "--n-layer", "6", "--n-head", "6",
       "--n-embd", "384", "--vocab", "65"]


def test_gpt_step_times_each_flavour_against_pytorch_cuda():
    gpt = runs_of(steps_of(facts())["gpt"])
    assert list(gpt) == ["cupy +torch", "numba +torch"]
    for f in ("cupy", "numba"):
        run = gpt[f"{f} +torch"]
        assert run.argv == ["py", f"{ROOT}/benchmarks/gpt_step.py", "--device", "cuda",
                            "--kernels", f] + GPT + ["--json", f"/w/gpt-{f}.json", "--rounds",
                                                     "3", "--steps", "10"]
        assert run.skip is None and 0 < run.expect < run.timeout
    quick = runs_of(steps_of(facts(), "--quick")["gpt"])["numba +torch"]
    assert quick.argv[-6:] == ["--rounds", "2", "--steps", "5", "--warmup", "2"]
    assert quick.expect < gpt["numba +torch"].expect
    # a torch that does not see the GPU: ours alone, and the comparison skipped with the reason
    alone = runs_of(steps_of(facts(torch="torch.cuda.is_available() is False"))["gpt"])
    assert set(alone) == {"cupy", "numba", "torch"}
    assert "--no-torch" in alone["numba"].argv and "--no-torch" not in gpt["numba +torch"].argv
    assert alone["torch"].skip == "no PyTorch CUDA: torch.cuda.is_available() is False"
    nvrtc = "a 4-element test kernel failed: RuntimeError: no NVRTC"
    numba_only = steps_of(facts(flavours={"cupy": nvrtc, "numba": None}))["gpt"]
    assert [r.name for r in numba_only.runs] == ["numba +torch"]
    none = steps_of(facts(flavours={"cupy": "no CuPy", "numba": "no device"}))["gpt"]
    assert none.skip == "no usable CUDA kernel flavour (cupy: no CuPy; numba: no device)"
    assert steps_of(facts(), "--skip", "gpt")["gpt"].skip == "not selected (--only/--skip)"


def test_a_flavour_that_cannot_compile_leaves_its_tests_out_with_the_reason():
    nvrtc = "a 4-element test kernel failed: RuntimeError: CuPy failed to load libnvrtc.so.12"
    steps = steps_of(facts(flavours={"cupy": nvrtc, "numba": None}))
    kernels = runs_of(steps["kernels"])
    argv = kernels["pytest"].argv
    assert argv[argv.index("-k") + 1] == "numba"
    assert kernels["cupy"].skip == f"cupy flavour unusable: {nvrtc}"
    tests1 = steps["tests-1"].runs[0].argv
    assert tests1[tests1.index("-k") + 1] == "(numba)"
    tests2 = steps["tests-2"].runs[0].argv
    assert tests2[tests2.index("-k") + 1] == "numba"
    assert runs_of(steps["train"])["lenet cuda-cupy"].skip == nvrtc
    quick = steps_of(facts(mpiexec=None, flavours={"cupy": nvrtc, "numba": None}), "--quick")
    tests1 = quick["tests-1"].runs[0].argv
    assert tests1[tests1.index("-k") + 1] == "(numba) and not test_cli_matches_cpu"
    everything = steps_of(facts())                          # both usable: no -k, no record
    assert "-k" not in everything["kernels"].runs[0].argv
    assert "-k" not in everything["tests-2"].runs[0].argv
    assert len(everything["kernels"].runs) == 1


def test_blocker_only_and_quick():
    steps = steps_of(facts(blocker="RuntimeError: cannot load MPI library"))
    assert steps["nvidia-smi"].skip is None
    assert all("cannot load MPI library" in s.skip for n, s in steps.items() if n != "nvidia-smi")
    only = steps_of(facts(), "--only", "train", "--skip", "train")
    assert all(s.skip == "not selected (--only/--skip)" for s in only.values())
    quick = steps_of(facts(), "--quick")
    assert {r.name for r in quick["train"].runs} == {"lenet cpu", "lenet cuda-cupy",
                                                     "lenet cuda-numba"}
    assert set(runs_of(quick["allreduce"])) == {"host 2 ranks, shared GPU",
                                                "nccl 1 ranks, one per GPU"}
    assert opts("--quick").budget == 180 and opts().budget == 540


# --- the probe ---------------------------------------------------------------------------------

# CuPy as tests/support/fake_cupy.py emulates it (kernels compiled for the host), one device
STUB_CUPY = """
import sys, types
from tests.support import fake_cupy
cp = fake_cupy.module()
cp.cuda.Device = lambda i: types.SimpleNamespace(use=lambda: None)
if {broken!r}:
    class ElementwiseKernel(fake_cupy.ElementwiseKernel):
        def __call__(self, *args):
            raise RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: "
                               "cannot open shared object file: No such file or directory")
    cp.ElementwiseKernel = ElementwiseKernel
sys.modules["cupy"] = cp
"""


def probe_with_stub_cupy(tmp_path, broken):
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "cupy.py").write_text(STUB_CUPY.format(broken=broken))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stub), str(ROOT)]),
               NUMBA_ENABLE_CUDASIM="0")
    return gc.probe(env, sys.executable)


def test_probe_finds_a_cupy_that_cannot_compile_a_kernel(tmp_path):
    got = probe_with_stub_cupy(tmp_path, broken=True)
    assert "blocker" not in got, got
    assert got["flavours"]["cupy"] == (
        "a 4-element test kernel failed: RuntimeError: CuPy failed to load libnvrtc.so.12: "
        "OSError: libnvrtc.so.12: cannot open shared object file: No such file or directory")


def test_probe_runs_the_kernel_of_a_working_cupy(tmp_path):
    from tests.support import fake_cupy
    if not fake_cupy.compiler_available():
        pytest.skip("no host C++ compiler (g++) to run the CuPy kernel sources")
    assert probe_with_stub_cupy(tmp_path, broken=False)["flavours"]["cupy"] is None


# --- the runner --------------------------------------------------------------------------------

def py(code):
    return [sys.executable, "-c", code]


def report_in(tmp_path):
    return gc.Report(tmp_path / "out", {"facts": {}})


def test_runner_records_pass_fail_skip_timeout_and_check(tmp_path):
    def wrong():
        raise gc.CheckFailed("parameters differ", {"max_abs_err": 1.0})

    def skipped_inside():
        raise gc.SkipRun("transport not available")

    steps = [
        gc.Step("ok", [gc.Run("print", py("print('hello from ok')"), 30,
                              check=lambda: {"value": 1})]),
        gc.Step("bad", [gc.Run("exit 3", py("import sys; sys.exit(3)"), 30),
                        gc.Run("not needed", ["false"], 30, skip="no torch")]),
        gc.Step("slow", [gc.Run("sleep", py("import time; time.sleep(60)"), 1)]),
        gc.Step("wrong", [gc.Run("check", py("pass"), 30, check=wrong)]),
        gc.Step("inner-skip", [gc.Run("check", py("pass"), 30, check=skipped_inside)]),
        gc.Step("absent", [gc.Run("x", ["true"], 30)], skip="no mpiexec"),
    ]
    report = report_in(tmp_path)
    records = {r["name"]: r for r in gc.run_steps(steps, report, dict(os.environ),
                                                   str(tmp_path), time.monotonic() + 600)}
    assert records["ok"]["status"] == "passed"
    assert records["ok"]["runs"][0]["results"] == {"value": 1}
    assert [r["status"] for r in records["bad"]["runs"]] == ["failed", "skipped"]
    assert records["bad"]["runs"][0]["reason"] == "exit code 3"
    assert records["bad"]["runs"][1]["reason"] == "no torch"
    assert records["slow"]["status"] == "failed"
    assert records["slow"]["runs"][0]["reason"].startswith("timeout after")
    assert records["wrong"]["runs"][0]["reason"] == "parameters differ"
    assert records["wrong"]["runs"][0]["results"] == {"max_abs_err": 1.0}
    assert records["inner-skip"]["status"] == "skipped"
    assert (records["absent"]["status"], records["absent"]["reason"]) == ("skipped", "no mpiexec")
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["summary"] == {"passed": 1, "failed": 3, "skipped": 2}
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "hello from ok" in log and "== bad / exit 3: failed" in log


def test_report_is_written_before_each_run(tmp_path):
    """A run sees the report as a kill would leave it: earlier runs done, itself running."""
    snap = tmp_path / "snap.json"
    copy = py(f"import shutil; shutil.copy({str(tmp_path / 'out' / 'report.json')!r}, "
              f"{str(snap)!r})")
    steps = [gc.Step("first", [gc.Run("a", py("pass"), 30)]),
             gc.Step("second", [gc.Run("b", copy, 30)]),
             gc.Step("third", [gc.Run("c", py("pass"), 30)])]
    gc.run_steps(steps, report_in(tmp_path), dict(os.environ), str(tmp_path),
                 time.monotonic() + 600)
    seen = {s["name"]: s for s in json.loads(snap.read_text())["steps"]}
    assert seen["first"]["status"] == "passed"
    assert seen["second"]["runs"][0]["status"] == "running"
    assert seen["third"]["status"] == "pending"


def test_spent_budget_skips_the_rest(tmp_path):
    steps = [gc.Step("late", [gc.Run("a", py("pass"), 30)])]
    [rec] = gc.run_steps(steps, report_in(tmp_path), dict(os.environ), str(tmp_path),
                         time.monotonic())
    assert rec["status"] == "skipped"
    assert rec["reason"] == "time budget spent: needs 30 s, 0 s left"


def test_a_run_starts_only_if_it_fits_and_a_budget_cut_off_is_skipped(tmp_path):
    """Budget 6 s: a run killed by its own 1 s timeout failed; one whose 30 s timeout does not
    fit is not started; one expected to take 1 s starts, and the budget's end cuts it off."""
    sleep = py("import time; time.sleep(60)")
    steps = [gc.Step("own-timeout", [gc.Run("sleep", sleep, 1)]),
             gc.Step("too-long", [gc.Run("pass", py("pass"), 30)]),
             gc.Step("cut-off", [gc.Run("sleep", sleep, 600, expect=1)])]
    start = time.monotonic()
    records = {r["name"]: r["runs"][0] for r in gc.run_steps(
        steps, report_in(tmp_path), dict(os.environ), str(tmp_path), start + 6)}
    assert time.monotonic() - start < 20
    own = records["own-timeout"]
    assert (own["status"], own["reason"]) == ("failed", "timeout after 1 s")
    long = records["too-long"]
    assert long["status"] == "skipped" and "rc" not in long
    assert long["reason"].startswith("time budget spent: needs 30 s, ")
    assert long["reason"].endswith(" s left")
    cut = records["cut-off"]
    assert cut["status"] == "skipped" and cut["rc"] is None
    assert cut["reason"].startswith("time budget spent: cut off after ")
    assert cut["reason"].endswith(" s (its timeout: 600 s)")
    doc = json.loads((tmp_path / "out" / "report.json").read_text())
    assert doc["summary"] == {"failed": 1, "skipped": 2}


def test_planned_runs_expect_less_than_their_timeout():
    steps = steps_of(facts())
    assert list(gc.STEPS).index("gpt") == len(gc.STEPS) - 1   # after the checks it may crowd out
    assert list(gc.STEPS).index("step") > \
        list(gc.STEPS).index("train") > list(gc.STEPS).index("kernels")   # a warm JIT cache
    runs = [r for s in steps.values() for r in s.runs]
    assert all(r.expect is None or 0 < r.expect < r.timeout for r in runs)
    train = runs_of(steps["train"])
    assert train["lenet cuda-numba"].expect < train["lenet cuda-numba"].timeout


# --- the checks --------------------------------------------------------------------------------

def test_compare_npz(tmp_path):
    w = {"0.weight": np.ones((3, 2), np.float32), "0.bias": np.zeros(3, np.float32)}
    np.savez(tmp_path / "cpu.npz", **w)
    np.savez(tmp_path / "near.npz", **{k: v + 1e-7 for k, v in w.items()})
    np.savez(tmp_path / "far.npz", **dict(w, **{"0.bias": w["0.bias"] + 0.1}))
    np.savez(tmp_path / "names.npz", weight=w["0.weight"])
    got = gc.compare_npz(str(tmp_path / "near.npz"), str(tmp_path / "cpu.npz"))
    assert set(got["max_abs_err"]) == set(w) and max(got["max_abs_err"].values()) < 1e-6
    with pytest.raises(gc.CheckFailed, match="0.bias max abs err 0.1"):
        gc.compare_npz(str(tmp_path / "far.npz"), str(tmp_path / "cpu.npz"))
    with pytest.raises(gc.CheckFailed, match="names differ"):
        gc.compare_npz(str(tmp_path / "names.npz"), str(tmp_path / "cpu.npz"))
    with pytest.raises(gc.CheckFailed, match="no CPU reference"):
        gc.compare_npz(str(tmp_path / "near.npz"), str(tmp_path / "missing.npz"))


def test_gpt_summary_checks_the_first_batch_losses(tmp_path):
    doc = dict(config={"batch": 64, "kernels": "cuda-numba"}, ours_loss=4.1744, ours_ms=80.0,
               rounds=[{"ours_ms": 80.0, "torch_ms": 40.0, "ratio": 2.0}], torch_loss=4.1745,
               torch_ms=40.0, ratio=2.0)
    (tmp_path / "ok.json").write_text(json.dumps(doc))
    got = gc.gpt_summary(str(tmp_path / "ok.json"))
    assert "rounds" not in got and (got["ours_ms"], got["torch_ms"], got["ratio"]) == (80, 40, 2)
    assert got["loss_rel_diff"] == pytest.approx(1e-4 / 4.1745)
    (tmp_path / "far.json").write_text(json.dumps(dict(doc, ours_loss=4.3)))
    with pytest.raises(gc.CheckFailed, match=r"first-batch loss: ours 4.300000, PyTorch 4.174500"):
        gc.gpt_summary(str(tmp_path / "far.json"))
    (tmp_path / "nan.json").write_text(json.dumps(dict(doc, ours_loss=float("nan"))))
    with pytest.raises(gc.CheckFailed, match="ours nan"):
        gc.gpt_summary(str(tmp_path / "nan.json"))
    alone = {k: v for k, v in doc.items() if not k.startswith(("torch", "ratio"))}
    (tmp_path / "alone.json").write_text(json.dumps(alone))
    assert gc.gpt_summary(str(tmp_path / "alone.json"))["ours_ms"] == 80.0


def junit_file(path, cases):
    body = "".join(f'<testcase classname="t" name="{name}">{inner}</testcase>'
                   for name, inner in cases)
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}'
                    f'</testsuite></testsuites>')
    return str(path)


def test_junit_counts_by_flavour(tmp_path):
    skip = '<skipped message="no CuPy"/>'
    ok = junit_file(tmp_path / "ok.xml", [("test_k[fill-cupy]", skip), ("test_k[fill-numba]", ""),
                                          ("test_k[copy-numba]", "")])
    got = gc.junit(ok, by_flavour=True)
    assert (got["passed"], got["skipped"], got["skip_reasons"]) == (2, 1, ["no CuPy"])
    assert got["by_flavour"]["numba"] == {"passed": 2, "failed": [], "skipped": 0}
    assert got["by_flavour"]["cupy"] == {"passed": 0, "failed": [], "skipped": 1}
    bad = junit_file(tmp_path / "bad.xml", [("test_k[gemm-numba]", '<failure message="x"/>'),
                                            ("test_k[fill-numba]", "")])
    with pytest.raises(gc.CheckFailed, match=r"1 failed: test_k\[gemm-numba\]"):
        gc.junit(bad)
    all_skipped = junit_file(tmp_path / "skip.xml", [("test_a", skip)])
    with pytest.raises(gc.SkipRun, match=r"all 1 tests skipped \(no CuPy\)"):
        gc.junit(all_skipped)


def test_uninstalled_source_tree_maps_kernels(tmp_path):
    """What gpu_check runs on a bare GPU machine: PYTHONPATH=<repo>, no install. The venv's
    editable-install finder is removed first, so only mpitrain/__init__.py can map kernels/."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
            "if 'editable' not in type(f).__module__ and 'editable' not in repr(f)]; "
            "import mpitrain as m, mpitrain.kernels as k, mpitrain.kernels.cpu as c; "
            "assert m.kernels is k; print(m.__file__); print(k.__file__); print(c.__file__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr
    pkg, kernels, cpu = res.stdout.split()
    assert pkg == str(ROOT / "mpitrain" / "__init__.py")
    assert kernels == str(ROOT / "kernels" / "__init__.py")
    assert cpu == str(ROOT / "kernels" / "cpu" / "__init__.py")


def test_every_run_shares_one_numba_cache_in_the_work_dir(tmp_path):
    bin_dir = fake_smi(tmp_path, FAKE_SMI.replace('echo "fake nvidia-smi $*"',
                                                  'echo "cache=$NUMBA_CACHE_DIR"'))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--only", "nvidia-smi", "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(env, PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
                                  NUMBA_ENABLE_CUDASIM="0"))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((out / "report.json").read_text())
    cache = os.path.join(doc["work_dir"], "numba-cache")
    assert doc["numba_cache_dir"] == cache
    assert f"cache={cache}" in (out / "gpu-check.log").read_text()


def test_dry_run_with_a_fake_gpu_writes_the_plan(tmp_path):
    bin_dir = fake_smi(tmp_path)
    out = tmp_path / "out"
    res = run_script(["--dry-run", "--out", str(out)], f"{bin_dir}{os.pathsep}"
                     f"{os.environ.get('PATH', '')}", tmp_path, NUMBA_ENABLE_CUDASIM="0")
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in doc["steps"]] == list(gc.STEPS)
    assert doc["facts"]["gpus"] == ["GPU 0: Fake H100 (UUID: GPU-0)"]
    assert doc["facts"]["mpitrain"] == str(ROOT / "mpitrain" / "__init__.py")   # this tree
    steps = {s["name"]: s for s in doc["steps"]}
    assert steps["nvidia-smi"]["status"] == "planned"
    # no real device here: every CUDA step is skipped with both flavours' reasons
    assert steps["train"]["status"] == "skipped"
    assert "no usable CUDA kernel flavour (cupy:" in steps["train"]["reason"]
    assert steps["gpt"]["status"] == "skipped"
    assert steps["gpt"]["reason"] == steps["train"]["reason"]
    assert (out / "gpu-check.log").exists()
    assert not os.path.exists(doc["work_dir"])          # scratch removed, also after a dry run


def test_dry_run_on_the_simulator_lists_the_gpt_command_lines(tmp_path):
    """NUMBA_ENABLE_CUDASIM=1: the probe finds the Numba flavour usable, so the report lists the
    gpt step's run with its whole command; without a torch that sees a GPU, ours alone."""
    bin_dir = fake_smi(tmp_path)
    out = tmp_path / "out"
    res = run_script(["--dry-run", "--only", "gpt", "--out", str(out)], f"{bin_dir}{os.pathsep}"
                     f"{os.environ.get('PATH', '')}", tmp_path, NUMBA_ENABLE_CUDASIM="1")
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "report.json").read_text())
    if doc["facts"]["flavours"]["numba"] is not None:
        pytest.skip(f"numba flavour unusable here: {doc['facts']['flavours']['numba']}")
    gpt = next(s for s in doc["steps"] if s["name"] == "gpt")
    assert gpt["status"] == "planned"
    runs = {r["name"]: r for r in gpt["runs"]}
    torch = "" if doc["facts"]["torch"] is None else " --no-torch"
    numba = runs["numba" + (" +torch" if not torch else "")]
    assert numba["cmd"] == (f"{sys.executable} {ROOT}/benchmarks/gpt_step.py --device cuda "
                            f"--kernels numba {' '.join(GPT)} --json {doc['work_dir']}/"
                            f"gpt-numba.json{torch} --rounds 3 --steps 10")
    assert numba["skip"] is None and numba["timeout_s"] == 240
    if torch:
        assert runs["torch"]["skip"] == f"no PyTorch CUDA: {doc['facts']['torch']}"
