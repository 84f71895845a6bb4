"""Thread budget per rank: cores // ranks-on-this-node, >= 1, overridable; applied to live pools."""
import os
import subprocess
import sys

import numba
import pytest

from mpitrain.runtime import threads
from mpitrain.kernels.cpu import conv as cpu_conv


@pytest.mark.parametrize("local_size, cores, expected", [
    (1, 2, 2), (2, 2, 1), (4, 2, 1), (3, 16, 5), (1, 1, 1), (0, 8, 8)])
def test_default_is_cores_over_local_size_at_least_one(local_size, cores, expected):
    assert threads.default_threads(local_size, cores) == expected


def test_local_size_from_launcher_environment():
    assert threads.local_size_from_env({}) == 1
    assert threads.local_size_from_env({"MPI_LOCALNRANKS": "4"}) == 4             # MPICH hydra
    assert threads.local_size_from_env({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3  # Open MPI
    assert threads.local_size_from_env({"MPI_LOCALNRANKS": "x"}) == 1


@pytest.fixture
def restore_threads():
    saved_env = {k: os.environ.get(k) for k in threads._ENV_VARS}
    saved_numba = numba.get_num_threads()
    saved_blas = threads.blas_threads()
    saved_conv = cpu_conv.THREADS
    yield
    cpu_conv.THREADS = saved_conv
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    numba.set_num_threads(saved_numba)
    if saved_blas:
        threads._set_blas_threads(saved_blas)


def test_configure_resizes_running_pools_and_exports_env(restore_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)      # no user setting: the default
    assert threads.configure(1) == 1
    assert numba.get_num_threads() == 1
    assert threads.blas_threads() in (1, None)  # None only without a known BLAS
    assert all(os.environ[k] == "1" for k in threads._ENV_VARS)
    n = threads.configure(0, local_size=1)
    assert n == threads.cores() and os.environ["OMP_NUM_THREADS"] == str(n)
    assert threads.blas_threads() in (n, None)
    # The budget goes to BLAS and to the convolution's gathered path (BLAS is idle while it
    # runs); Numba stays on one thread so the two pools never fight.
    assert numba.get_num_threads() == 1 and cpu_conv.THREADS == n
    threads.configure(1)
    assert cpu_conv.THREADS == 1


def test_configure_then_compile_in_a_fresh_process():
    """Numba re-reads NUMBA_NUM_THREADS at each compilation and raises if it no longer matches the
    launched pool; configure() must leave it alone so an uncached kernel still compiles."""
    code = ("import numba, mpitrain.runtime.threads as t\n"
            "t.configure(1)\n"
            "f = numba.njit(lambda a: a + 1)\n"
            "print(f(41))\n")
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "42"


def test_init_applies_the_budget_to_a_users_own_loop():
    """mt.init() gives BLAS the CLI's budget (a user's loop was 4-15x slower without it), with
    MPITRAIN_THREADS and init(threads=n) to override, a user's exported OMP_NUM_THREADS
    honoured, and init(threads=None) to opt out."""
    code = ("import os, mpitrain as mt\n"
            "from mpitrain.runtime import threads as t\n"
            "def show(omp=None, **kw):\n"
            "    os.environ.pop('OMP_NUM_THREADS', None)\n"
            "    os.environ.update({} if omp is None else {'OMP_NUM_THREADS': omp})\n"
            "    mt.init(**kw)\n"
            "    print(os.environ['OMP_NUM_THREADS'], t.blas_threads())\n"
            "    mt.shutdown()\n"
            "show(); show('7', threads=None); show(threads=3); show('2')\n"
            "os.environ['MPITRAIN_THREADS'] = '1'; show('2')\n"
            "for bad in ({'threads': -1}, {'threads': 1.5}):\n"
            "    try:\n"
            "        mt.init(**bad)\n"
            "    except ValueError as e:\n"
            "        print('error', e)\n"
            "os.environ['MPITRAIN_THREADS'] = 'many'\n"
            "try:\n"
            "    mt.init()\n"
            "except ValueError as e:\n"
            "    print('error', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "MPITRAIN_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    n = threads.cores()                         # one rank on this machine: every core
    has_blas = lines[0].split()[1] != "None"
    for line, want_env, want_blas in zip(lines, [n, 7, 3, 2, 1], [n, None, 3, 2, 1]):
        env_value, blas = line.split()
        assert int(env_value) == want_env, line
        if has_blas and want_blas is not None:
            assert int(blas) == want_blas, line
    assert "init(threads=-1)" in lines[5] and "init(threads=1.5)" in lines[6]
    assert lines[7].startswith("error MPITRAIN_THREADS='many'")


def _spin_after_configure(extra_env):
    """OPENBLAS_THREAD_TIMEOUT and the live OpenBLAS's timeout after configure(2), in a fresh
    process (the variable is read once per pool start)."""
    code = ("import os, numpy as np\n"
            "from mpitrain.runtime import threads\n"
            "a = np.ones((512, 512), np.float32); a @ a\n"       # start the pool first
            "threads.configure(2)\n"
            "a @ a\n"
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), threads.blas_spin())\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_configure_shortens_openblas_spinning_unless_the_user_set_it():
    exported, live = _spin_after_configure({})
    assert exported == str(threads.BLAS_SPIN)
    if live != "None":                                   # an OpenBLAS is loaded: it took it
        assert int(live) == threads.BLAS_SPIN
    exported, live = _spin_after_configure({"OPENBLAS_THREAD_TIMEOUT": "25"})
    assert exported == "25" and live in ("25", "None")
