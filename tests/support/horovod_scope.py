"""Which of Horovod's torch tests are not run against mpitrain.torch, and why (docs/pytorch.md,
"Horovod's own test suite", gives the same list). run.py leaves them out of the jobs it starts;
horovod_shim.py marks them skipped, with the reason, in a job that collects them.

They check Horovod's internals or a design mpitrain does not share, rather than the public
behaviour, expect values that Horovod's own arithmetic does not give at some N, or time
themselves in a way that more ranks than cores breaks.
"""

ORDER = ("its ranks make their calls in different orders (an async call before a barrier on "
         "rank 0, after it on the others): Horovod matches collectives by name, mpitrain by "
         "call order, so this is a CollectiveError; the name rule itself is tested in "
         "tests/mpi/test_torch_horovod_parity.py")
OUT_OF_SCOPE = {
    "test_optimizer_no_named_parameters": "reads the optimizer's private _parameter_names",
    "test_horovod_allreduce_duplicate_name_error": ORDER,
    "test_horovod_allgather_duplicate_name_error": ORDER,
    "test_horovod_broadcast_duplicate_name_error": ORDER,
    "test_horovod_reducescatter_duplicate_name_error": ORDER,
}

# Tests whose expected values, at some numbers of ranks only, are not what Horovod's own
# arithmetic gives: {name: (sizes, why)}.
PRESCALE = ("at N = 3 it expects 3 x a float16 value, unrounded, from a float16 sum: no "
            "float16 result equals it")
OUT_OF_SCOPE_AT = {
    "test_horovod_allreduce_prescale": ({3}, PRESCALE),
    "test_horovod_reducescatter_prescale": ({3}, PRESCALE),
    "test_horovod_grouped_reducescatter_prescale": ({3}, PRESCALE),
    "test_horovod_join_allreduce": ({1, 3}, "at N = 1 it expects join() to return a rank other "
                                            "than the only one; at N = 3 a float32 division by "
                                            "3 where Horovod multiplies by the float32 1/3"),
}

# Wall-clock bounds at N = 3, where make test runs 3 ranks on 2 cores: rank 0 sleeps 5 s
# before a barrier and every rank asserts it waited at least 5 s from its own clock's start,
# so a rank scheduled a little after rank 0 measures just under 5 s (in Horovod as here).
TIMING = ("it asserts that each rank waited >= 5 s at a barrier, timed from that rank's own "
          "start: with more ranks than cores a rank that starts late measures less")
for _name in ("test_global_barrier_op", "test_process_set_barrier_op"):
    OUT_OF_SCOPE_AT.setdefault(_name, ({3}, TIMING))

# Refused by design: replicas built from different random parameters step before they are
# broadcast, and mpitrain.torch's first step raises on every rank that they differ.
DIFFERENT_REPLICAS = ("it steps replicas that start from different parameters, which the "
                      "first step refuses on every rank (DDP broadcasts; Horovod lets them "
                      "train apart)")
for _name in ("test_broadcast_state", "test_broadcast_state_options",
              "test_dynamic_requires_grad", "test_no_named_parameters",
              "test_sparse_embeddings"):
    OUT_OF_SCOPE_AT.setdefault(_name, ({2, 3, 4}, DIFFERENT_REPLICAS))


def why_not(name, size):
    """Why test ``name`` is not run at ``size`` ranks, or None when it is."""
    if name in OUT_OF_SCOPE:
        return OUT_OF_SCOPE[name]
    sizes, why = OUT_OF_SCOPE_AT.get(name, ((), None))
    return why if size in sizes else None
