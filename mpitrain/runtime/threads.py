"""Thread budget per rank: cores / ranks-on-this-node threads, at least 1, given to BLAS.

N ranks on one machine each starting a BLAS pool and a Numba pool as wide as the machine gives N x
cores threads fighting for cores -- the CPU scaling trap most reported by Horovod users. Each rank
therefore defaults to ``max(1, cores // local_size)`` threads; ``--threads`` / MPITRAIN_THREADS
overrides it.

The budget goes to BLAS, and the Numba kernels run on one thread. Two pools on the same cores
fight: OpenBLAS workers spin for a while after each GEMM, exactly when the Numba workers want the
cores for the next elementwise kernel. Measured on the 2-core box, one rank, batch 64, ms/step
(BLAS + Numba threads): MLP 1+1 10.3, 2+1 5.6, 1+2 9.7, 2+2 26.4; LeNet 1+1 102.7, 2+1 84.2,
1+2 84.1, 2+2 135.7 (docs/benchmarks.md). The GEMMs are most of every step, so BLAS gets the
cores; the Numba kernels are memory-bound and gain little from a second thread. The exception is
the CPU convolution's gathered path (kernels/cpu/conv.py), compute-bound Numba GEMMs that call
no BLAS: it splits a batch over the same budget with its own threads (``conv.THREADS``;
one rank, 2 threads, ResNet-20 214 -> 144 ms/step).

When it is set matters: OpenBLAS and MKL read OMP_NUM_THREADS & co. once, when they are loaded,
and NumPy (hence BLAS) is already loaded by the time ``python -m mpitrain`` runs our code (the
package's ``__init__`` imports it). So ``configure`` does both: it exports the variables (for
libraries not loaded yet and for child processes) and resizes the pools already running --
``numba.set_num_threads`` and the BLAS library's own ``*_set_num_threads`` found in the process's
loaded libraries. The local size is read from the launcher's environment before MPI is involved.

OpenBLAS's workers spin after each multi-threaded GEMM for 2**OPENBLAS_THREAD_TIMEOUT CPU cycles
(28 by default: about 0.1 s; 30-60 ms of spinning measured here after one 1024^3 product) before
they sleep, on the cores the next kernel -- the convolution's threads, or the other rank's work --
wants. ``configure`` shortens that to 2**20 cycles (under a millisecond: they still spin between
the GEMMs of one layer) unless the user set the variable: it exports it, has the loaded OpenBLAS
re-read its environment and restarts its pool, which reads the timeout when it starts
(``openblas_read_env``, ``blas_thread_shutdown_``; the pool comes back at the next multi-threaded
GEMM). A GEMM split over sleeping workers wakes them; it is split the same way, so results do not
change. One rank, 2 threads, the GPT "baby" step, same-run rounds: 304 -> 211 ms median with the
2 cores overloaded, 37.5 -> 36.6 ms at load ~1.3 (docs/benchmarks.md, "Two threads a rank").

Whose number wins, first to last: an explicit count (``--threads``, ``init(threads=n)``,
``MPITRAIN_THREADS``); a front end's pool the user sized before initialising (mpitrain.torch:
``torch.set_num_threads`` called before ``hvd.init()``); an ``OMP_NUM_THREADS`` the user
exported (not one ``configure`` exported itself); else cores / local ranks. Front ends with a
thread pool of their own (``add_pool``: torch's intra-op pool) get the same number, whichever
path initialised mpitrain -- ``hvd.init()``, or any call that initialises on its own -- because
Numba's OpenMP layer, started here, resizes a pool that shares its OpenMP runtime (torch's went
from 1 to 2 threads a rank with two ranks on two cores).

``mt.init()`` applies the same budget (``init(threads=...)``; ``MPITRAIN_THREADS``), so a user's own
loop gets the CLI's fast default: measured at N=2 on 2 cores, a loop left with a BLAS pool per rank
as wide as the machine ran ~320 ms/step against 22-28 ms with one thread per rank.
"""
import ctypes
import os

from mpitrain.runtime import env

# BLAS variables only: Numba re-reads NUMBA_NUM_THREADS from os.environ at every compilation and
# raises if it differs from the size of a pool already launched, so we never write it.
_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# Setter symbols of the BLAS builds NumPy wheels ship (scipy-openblas, 32/64-bit ints) and others.
_BLAS_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                 "openblas_set_num_threads64_", "openblas_set_num_threads",
                 "MKL_Set_Num_Threads")
_BLAS_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                 "openblas_get_num_threads64_", "openblas_get_num_threads", "MKL_Get_Max_Threads")
# OpenBLAS: spin 2**BLAS_SPIN cycles after a GEMM before sleeping (see above; 4..30, default 28).
BLAS_SPIN = 20
_spin_exported = None       # the value configure exported (a user's own setting is left alone)
_exported = None            # the OMP_NUM_THREADS value configure exported last
_user_omp = None            # the OMP_NUM_THREADS value the user exported, as last seen
_configured = None          # the budget configure applied last, or None
_pools = []                 # front ends' pools: (requested, resize), see add_pool
env.declare("MPITRAIN_THREADS")
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE")


def cores():
    """Cores this process may run on (affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_size_from_env(environ=None):
    """Ranks on this node as the launcher announces it (1 when not launched by mpiexec)."""
    environ = os.environ if environ is None else environ
    for key in _LOCAL_SIZE_VARS:
        try:
            return max(1, int(environ[key]))
        except (KeyError, ValueError):
            continue
    return 1


def default_threads(local_size=None, n_cores=None):
    local_size = local_size_from_env() if local_size is None else local_size
    n_cores = cores() if n_cores is None else n_cores
    return max(1, n_cores // max(1, local_size))


def from_env(environ=None, default=0):
    """``MPITRAIN_THREADS`` (0 = the default budget); mt.init and the CLI's --threads read it."""
    return env.integer("MPITRAIN_THREADS", default, minimum=0, environ=environ)


def user_omp_threads():
    """``OMP_NUM_THREADS`` as the user exported it (a positive integer), else 0. A value that
    ``configure`` exported itself does not count, unless the user had exported it first."""
    global _user_omp
    value = os.environ.get("OMP_NUM_THREADS")
    if value != _exported:
        _user_omp = value
    if value is None or value != _user_omp:
        return 0
    try:
        return max(0, int(value))
    except ValueError:
        return 0


def resolve(threads=0, local_size=None):
    """The budget ``configure(threads, local_size)`` applies: ``threads`` when >= 1, else a
    pool's size its user set, else the user's OMP_NUM_THREADS, else the default."""
    if threads:
        return int(threads)
    for requested, _ in _pools:
        n = requested()
        if n:
            return n
    return user_omp_threads() or default_threads(local_size)


def add_pool(requested, resize):
    """A front end's thread pool follows the budget: ``requested()`` -> the size its user set
    since the pool was added (0: none), ``resize(n)`` applies the budget; at once, when a
    budget is already in force."""
    _pools.append((requested, resize))
    if _configured is not None:
        resize(_configured)


def configure(threads=0, local_size=None):
    """Give this rank's BLAS ``threads`` threads (0: resolve's choice), Numba one, the CPU
    convolution's gathered path as many (it runs while BLAS is idle) and every added pool as
    many; returns the number."""
    import numba

    from mpitrain.kernels.cpu import conv as cpu_conv

    global _exported, _configured
    user_omp_threads()          # whose OMP_NUM_THREADS it is, read before it is overwritten
    n = resolve(threads, local_size)
    _exported = str(n)
    for key in _ENV_VARS:
        os.environ[key] = _exported
    numba.set_num_threads(1)
    _shorten_blas_spin()
    _set_blas_threads(n)
    cpu_conv.THREADS = n
    _configured = n
    for _, resize in _pools:
        resize(n)
    return n


def _blas_libraries():
    """The loaded shared libraries that look like a BLAS (Linux: /proc/self/maps), opened with
    ctypes; one that cannot be opened is skipped."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return
    for path in sorted(p for p in paths if "blas" in os.path.basename(p).lower()
                       or "mkl_rt" in os.path.basename(p)):
        try:
            yield ctypes.CDLL(path)
        except OSError:
            continue


def _blas_functions(symbols):
    """Per loaded BLAS library, the first of ``symbols`` it exports (libraries without one are
    skipped)."""
    for lib in _blas_libraries():
        function = next((getattr(lib, s) for s in symbols if hasattr(lib, s)), None)
        if function is not None:
            yield function


def _set_blas_threads(n):
    for setter in _blas_functions(_BLAS_SETTERS):
        setter(ctypes.c_int(n))


def _shorten_blas_spin():
    """OpenBLAS's workers sleep 2**BLAS_SPIN cycles after a GEMM instead of 2**28 (see above),
    unless OPENBLAS_THREAD_TIMEOUT was set by the user; restarts the pool only when the value
    changes."""
    global _spin_exported
    value = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    if value is not None and value != _spin_exported:
        return
    _spin_exported = str(BLAS_SPIN)
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = _spin_exported
    for lib in _blas_libraries():
        if not all(hasattr(lib, s) for s in ("openblas_read_env", "openblas_thread_timeout",
                                              "blas_thread_shutdown_")):
            continue
        before = lib.openblas_thread_timeout()
        lib.openblas_read_env()
        if lib.openblas_thread_timeout() != before:
            lib.blas_thread_shutdown_()     # its next GEMM starts the pool, with the new timeout


def blas_spin():
    """The OpenBLAS thread timeout read from the environment (log2 of cycles; 0: its default),
    None if no OpenBLAS is loaded; for tests and logs."""
    for timeout in _blas_functions(("openblas_thread_timeout",)):
        return int(timeout())
    return None


def blas_threads():
    """The BLAS pool size now in force (None if no known BLAS is loaded); for tests and logs."""
    for getter in _blas_functions(_BLAS_GETTERS):
        return int(getter())
    return None
