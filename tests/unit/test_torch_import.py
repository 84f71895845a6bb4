"""mpitrain.torch is optional: the core never imports torch, and without torch the front end is
one ImportError line saying how to install it; with torch it offers horovod.torch's names."""
import subprocess
import sys

import pytest


def run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_the_core_does_not_import_torch():
    p = run("import sys, mpitrain; assert 'torch' not in sys.modules, 'torch imported'")
    assert p.returncode == 0, p.stderr


def test_without_torch_the_error_says_how_to_install_it():
    p = run("import sys; sys.modules['torch'] = None\nimport mpitrain.torch")
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last == ("ImportError: mpitrain.torch needs PyTorch: "
                    "pip install 'mpitrain[torch]'"), p.stderr


HOROVOD_TORCH = """init shutdown is_initialized rank size local_rank local_size cross_rank
cross_size Sum Average Min Max Product Adasum mpi_built mpi_enabled mpi_threads_supported
nccl_built cuda_built gloo_built rocm_built is_homogeneous allreduce allreduce_ allreduce_async
allreduce_async_ grouped_allreduce grouped_allreduce_ grouped_allreduce_async
grouped_allreduce_async_ allgather allgather_async broadcast broadcast_ broadcast_async
broadcast_async_ reducescatter reducescatter_async alltoall alltoall_async barrier join poll
synchronize broadcast_object allgather_object add_process_set remove_process_set
global_process_set ProcessSet start_timeline stop_timeline broadcast_parameters
broadcast_optimizer_state DistributedOptimizer Compression SyncBatchNorm""".split()


def test_horovod_torch_names_are_there():
    pytest.importorskip("torch")
    import mpitrain.torch as hvd
    missing = [name for name in HOROVOD_TORCH if not hasattr(hvd, name)]
    assert missing == []
    assert set(HOROVOD_TORCH) <= set(hvd.__all__)
    assert issubclass(hvd.CollectiveError, RuntimeError)
    assert hasattr(hvd.Compression.none, "compress") and hasattr(hvd.Compression.fp16,
                                                                 "decompress")
