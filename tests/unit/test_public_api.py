"""The public API promised to users (DESIGN_NAMES: the top-level ``mt.*`` names of the design's API
block) is the contract: every name exported, none lost."""
import mpitrain as mt
from mpitrain.comm import collectives

DESIGN_NAMES = """init shutdown is_initialized rank size local_rank local_size cross_rank cross_size
Sum Average Min Max Product allreduce allreduce_ grouped_allreduce allgather broadcast broadcast_
reducescatter alltoall barrier broadcast_object allgather_object CollectiveError
broadcast_parameters broadcast_optimizer_state Compression DistributedOptimizer
nn models optim data
start_timeline stop_timeline mpi_built mpi_threads_supported nccl_built cuda_built
is_homogeneous""".split()


def test_every_design_name_is_exported():
    missing = [n for n in DESIGN_NAMES if n not in mt.__all__ or not hasattr(mt, n)]
    assert not missing


def test_all_lists_only_real_names_and_every_collective():
    assert all(hasattr(mt, n) for n in mt.__all__)
    assert len(set(mt.__all__)) == len(mt.__all__)
    # the trainer's and the sharded optimizer's, not the user's
    internal = {"DTYPES", "fusion_threshold", "allgather_shares", "allgather_shares_async"}
    assert set(collectives.__all__) - internal <= set(mt.__all__)


def test_nested_contract_names():
    assert issubclass(mt.CollectiveError, RuntimeError)
    assert {"none", "fp16"} <= set(vars(mt.Compression))
    for method in ("no_sync", "backward_hook", "synchronize", "skip_synchronize"):
        assert callable(getattr(mt.DistributedOptimizer, method))
    for name in ("mlp", "lenet", "cifar_cnn"):
        assert callable(getattr(mt.models, name))
    assert callable(mt.nn.Parameter) and callable(mt.optim.SGD) and callable(mt.optim.Adam)
