"""Performance model: fit our ring's alpha/beta/gamma, predict step time and efficiency to N=1024.

    python benchmarks/perfmodel.py --allreduce out/bench/allreduce.json \
        --step out/bench/step.json --scaling out/bench/scaling-weak.json \
        --link 25Gbps,5us --link 100Gbps,2us --out out/bench

The model (docs/benchmarks.md, "Performance model", says the same with its limits). One ring
allreduce of n bytes over N ranks takes

    T(n, N) = 2(N-1) alpha  +  2(N-1)/N n beta  +  (N-1)/N n gamma

alpha: per-message latency (MPI + our Python per step), beta: seconds per byte on the link,
gamma: seconds per byte of the reduction kernel. A weak-scaling step (per-rank batch b) is

    T_step(N) = T_compute(b) * max(1, R/C)  +  [N > 1] sum over fusion buckets k of
                                                [T(n_k, N)  +  (p_k + 1) n_k mu]

with T_compute from the step benchmark, R ranks sharing a node of C cores (oversubscribed ranks
time-share), n_k the fusion plan's bucket sizes, p_k = 2 for a packed bucket (pack + unpack
copies; 0 for a tensor reduced in place) and one more pass for the 1/N of Average (mu: copy cost
per byte, measured here). At N = 1 DistributedOptimizer skips averaging altogether (no packing
either). That sum is the trainer's ``--no-overlap`` (one 64 MiB fusion plan averaged after
backward), and perfmodel.py's ``--no-overlap``.

By default the trainer overlaps: gradients in reverse layer order, buckets of <= 4 MiB, each
allreduced on one comm thread as soon as backward has produced it. The model builds the same
plan (``overlap_buckets``) and gives bucket k a ready time r_k T_bwd, r_k = the share of the
backward GEMM FLOPs done when its last layer is finished (ASSUMPTION: backward time goes as
its GEMM FLOPs; T_bwd = bwd_ms / step_ms of the step benchmark times T_compute). The comm thread
runs buckets first in, first out: start_k = max(ready_k, end_(k-1)), end_k = start_k +
T(n_k, N) + n_k mu (the 1/N pass); packing (n_k mu, main thread) delays backward, unpacking
follows the wait. T_step = T_compute + packs + max(0, end_last - backward end) + unpacks.
Where ranks fill the node (fewer than 2 cores per rank, as in the validation on a small box) the
comm thread shares the rank's core with backward (processor sharing, ``comm_thread_shared``),
which stretches backward by the comm work it overlaps; the projections (one rank per node)
give it a core of its own. Efficiency = T_step(1) / T_step(N); throughput = N b / T_step(N).

Identifiability. In T(n, N) beta and gamma always appear as (N-1)/N n (2 beta + gamma): ring
timings alone, at any set of N, determine alpha and 2 beta + gamma, never beta and gamma apart.
So the fit is one least-squares problem over two kinds of observations: ring timings
(rows [2(N-1), 2(N-1)/N n, (N-1)/N n]) and timings of the local reduce kernel alone (rows
[0, 0, n] plus a per-call constant), which pins gamma. Without reduce timings gamma is reported
as unknown and beta as the combined cost / 2 -- predictions on the measured network are the same
(they need only alpha and 2 beta + gamma), but a user link (which replaces beta, not gamma) then
charges the reduction at link speed. With N=2 data only, (N-1)/N is a constant, so nothing else is
lost; alpha comes from the intercept over message sizes, which needs at least two sizes.

Inputs: the JSON of the other benchmarks (inputs.py says which, and which keys it reads).

``--link BW,LAT`` (repeatable, e.g. 25Gbps,5us or 12.5GB/s,1.5us) replaces the network: alpha =
LAT + the fitted local alpha (our software per message does not go away), beta =
max(1/BW, fitted beta) (the slower of link and local copy); gamma and mu stay local.

Layout, one concept a file, in import order: errors.py (ModelError), network.py (the cost of one
allreduce on a network), fitting.py (the fits), inputs.py (the JSON and local timings read),
plans.py (the trainer's buckets, from mpitrain/comm/buckets.py), simulate.py (step time,
projection, validation), report.py (text, markdown, PNG), cli.py (the command line that
benchmarks/perfmodel.py runs). The names imported below are the package's API. Beside them,
hierarchical.py: flat vs hierarchical allreduce on M nodes x L ranks, with its own command line
(``python -m perfmodel_lib.hierarchical``).
"""
from .errors import ModelError
from .fitting import fit, fit_mpi, per_byte
from .inputs import (DEFAULT_BACKWARD_SHARE, backward_share, load_allreduce, load_backward_share,
                     load_scaling, load_step, measure_local, sweep_settings)
from .network import allreduce_time, mpi_time, network_params, parse_link, ring_time, tree_steps
from .plans import (OverlapPlan, backward_layers, fusion_plan, gradient_tensor_bytes, make_plans,
                    overlap_buckets)
from .simulate import (calibrate, comm_thread, comm_thread_shared, compute_time, overlap_schedule,
                       project, step_time, validate)
from .report import format_report

__all__ = [
    "ModelError", "fit", "fit_mpi", "per_byte", "DEFAULT_BACKWARD_SHARE", "backward_share",
    "load_allreduce", "load_backward_share", "load_scaling", "load_step", "measure_local",
    "sweep_settings", "allreduce_time", "mpi_time", "network_params", "parse_link",
    "ring_time", "tree_steps", "OverlapPlan", "backward_layers", "fusion_plan",
    "gradient_tensor_bytes", "make_plans", "overlap_buckets", "calibrate", "comm_thread",
    "comm_thread_shared", "compute_time", "overlap_schedule", "project", "step_time",
    "validate", "format_report",
]
