"""``python -m mpitrain.info`` and ``mpitrainrun --check-build``: one screen of what this
installation has, printed by rank 0 alone, exit 0; ``--json`` the same as one JSON object.

Every process runs under ``timeout -k 5 120`` (exit 124 or 137: it hung).
"""
import json
import re
import subprocess
import sys

from tests.support.launch import MPIEXEC, REPO, child_env

TIMEOUT = ["timeout", "-k", "5", "120"]
KEYS = {"mpitrain", "python", "numpy", "numba", "mpi", "comm", "kernels", "gpu", "front_ends",
        "settings", "unknown_settings"}
MPI_KEYS = {"mpi4py", "library", "standard", "thread_level", "ranks", "hosts", "job"}
COMM_KEYS = {"mpi_built", "mpi_threads_supported", "nccl_built", "cuda_built", "is_homogeneous"}


def run(cmd, **env):
    """``cmd`` in the repository with child_env(**env); the CompletedProcess, exit 0 asserted."""
    p = subprocess.run(TIMEOUT + cmd, cwd=REPO, env=child_env(**env), capture_output=True,
                       text=True, timeout=150)
    assert p.returncode == 0, f"{cmd}: exit {p.returncode}\n{p.stderr[-3000:]}"
    return p


def info(n=None, *args, **env):
    """``python -m mpitrain.info *args``, alone or under ``mpiexec -n n``."""
    launch = [] if n is None else [MPIEXEC, "-n", str(n)]
    return run(launch + [sys.executable, "-m", "mpitrain.info", *args], **env)


def test_alone_it_prints_one_screen_and_says_one_rank():
    p = info()
    out, lines = p.stdout, p.stdout.splitlines()
    assert re.match(r"mpitrain \d+\.\d+", lines[0]), out
    for label in ("Python", "NumPy", "Numba", "mpi4py", "MPI library", "MPI standard",
                  "thread level"):
        assert re.search(rf"^  {label} +\S", out, re.M), (label, out)
    assert re.search(r"^  MPI library +\S+", out, re.M), out
    assert re.search(r"^  thread level +MPI_THREAD_(SINGLE|FUNNELED|SERIALIZED|MULTIPLE)$",
                     out, re.M), out
    assert re.search(r"^  job +1 rank on 1 host: \S+ \(1\)$", out, re.M), out
    assert re.search(r"^  mpi_built +yes$", out, re.M), out
    for name in ("nccl_built", "cuda_built", "cpu/numba", "cuda/numba", "cuda/cupy", "torch",
                 "tensorflow", "keras"):
        assert re.search(rf"^  {re.escape(name)} +\S", out, re.M), (name, out)
    assert "  (none set)" in lines, out
    assert len(lines) <= 40, out                       # one screen
    assert "Traceback" not in out + p.stderr


def test_two_ranks_print_one_copy_naming_the_ranks_and_the_host():
    out = info(2).stdout
    assert re.search(r"^  job +2 ranks on 1 host: \S+ \(2\)$", out, re.M), out
    assert len(re.findall(r"^mpitrain ", out, re.M)) == 1, out
    assert out.count("MPI library") == 1, out


def test_json_is_one_object_with_every_key():
    alone = json.loads(info(None, "--json").stdout)
    two = json.loads(info(2, "--json").stdout)        # one object: rank 0's alone
    for report in (alone, two):
        assert KEYS <= set(report), sorted(report)
        assert MPI_KEYS <= set(report["mpi"]) and COMM_KEYS <= set(report["comm"])
        assert report["mpi"]["library"].strip()
        assert report["comm"]["mpi_built"] is True
        assert report["kernels"]["cpu/numba"]["available"] is True
        assert report["settings"] == {}
    assert alone["mpi"]["ranks"] == 1 and alone["mpi"]["job"].startswith("1 rank on 1 host")
    assert two["mpi"]["ranks"] == 2 and list(two["mpi"]["hosts"].values()) == [2]
    assert two["comm"]["is_homogeneous"] is True
    text = info().stdout
    assert f"  MPI library       {alone['mpi']['library']}" in text.splitlines()


def test_a_set_variable_is_shown_and_an_unknown_one_is_named():
    env = {"MPITRAIN_FUSION_THRESHOLD": "1048576", "MPITRAIN_FUSION_TRESHOLD": "1"}
    report = json.loads(info(2, "--json", **env).stdout)
    assert report["settings"] == {"MPITRAIN_FUSION_THRESHOLD": "1048576"}   # declared ones only
    assert any("MPITRAIN_FUSION_TRESHOLD" in line for line in report["unknown_settings"])
    out = info(None, **env).stdout
    assert "  MPITRAIN_FUSION_THRESHOLD=1048576" in out.splitlines(), out
    assert "(none set)" not in out


def test_check_build_prints_the_same_and_exits_0():
    launcher = run([sys.executable, "-m", "mpitrain.run", "--check-build"]).stdout
    assert launcher == info().stdout
    assert "MPI library" in launcher
