"""Run Horovod's own ``test/parallel/test_torch.py`` against mpitrain.torch, one mpiexec per test.

    HOROVOD_SOURCE=/path/to/horovod python tests/horovod_suite/run.py [--sizes 1,2,3] [-k WORD]

HOROVOD_SOURCE is a checkout of github.com/horovod/horovod (its tests are not in the PyPI
sdist, and none of its code is kept in this repository). Without it this prints one line and
exits 0: nothing to run. Each test runs alone, ``mpiexec -n N python -m pytest -p horovod_shim
<file>::TorchTests::<test>`` under a timeout, for each N: in one job the first failing test
would leave the ranks out of step for every later one. horovod_shim.py makes ``horovod.torch``
mpitrain.torch. The tests listed in OUT_OF_SCOPE, and in OUT_OF_SCOPE_AT at the sizes given
there (docs/pytorch.md, "Horovod's own test suite"), are not run. A test passes when it
passes on every rank, is skipped when no rank fails and some skip; anything else (a failure on any rank, a non-zero exit, the timeout) is a failure.
Prints the counts per N and the failures; exits 1 when any test failed.
"""
import argparse
import ast
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SUITE = os.path.join("test", "parallel", "test_torch.py")

# Tests that check Horovod's internals or a design mpitrain does not share, rather than the
# public behaviour; docs/pytorch.md ("Horovod's own test suite") gives the same list.
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
# Refused by design: replicas built from different random parameters step before they are
# broadcast, and mpitrain.torch's first step raises on every rank that they differ.
DIFFERENT_REPLICAS = ("it steps replicas that start from different parameters, which the "
                      "first step refuses on every rank (DDP broadcasts; Horovod lets them "
                      "train apart)")
for _name in ("test_broadcast_state", "test_broadcast_state_options",
              "test_dynamic_requires_grad", "test_no_named_parameters"):
    OUT_OF_SCOPE_AT.setdefault(_name, ({2, 3}, DIFFERENT_REPLICAS))
OUT_OF_SCOPE["test_sparse_embeddings"] = ("a sparse gradient needs sparse_as_dense=True "
                                          "in mpitrain.torch")


def test_names(path):
    """The TorchTests methods named test_*, in file order (read, not imported)."""
    tree = ast.parse(open(path).read(), path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TorchTests":
            return [f.name for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]
    raise SystemExit(f"{path}: no TorchTests class")


def verdict(folder, size, rc):
    """'passed', 'skipped' or 'failed' from every rank's outcome lines and the exit status."""
    outcomes = []
    for r in range(size):
        try:
            with open(os.path.join(folder, f"rank{r}.txt")) as f:
                outcomes += [line.split()[0] for line in f if line.strip()]
        except FileNotFoundError:
            return "failed"                       # a rank never reported
    if rc != 0 or "failed" in outcomes or not outcomes:
        return "failed"
    return "skipped" if "skipped" in outcomes else "passed"


def run_one(source, name, size, timeout, mpiexec):
    suite = os.path.join(source, SUITE)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, REPO] + [p for p in [os.environ.get(
                   "PYTHONPATH")] if p]))
    with tempfile.TemporaryDirectory() as folder:
        env["HOROVOD_SUITE_RESULTS"] = folder
        cmd = ["timeout", "-k", "5", str(timeout), mpiexec, "-n", str(size), sys.executable,
               "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "horovod_shim",
               f"{suite}::TorchTests::{name}"]
        proc = subprocess.run(cmd, env=env, cwd=os.path.join(source, "test"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return verdict(folder, size, proc.returncode), proc.stdout


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,3", help="numbers of ranks (default 1,2,3)")
    parser.add_argument("-k", default=None, help="only tests whose name contains this")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per test (180)")
    parser.add_argument("--log", default=None, help="write each failure's output here")
    args = parser.parse_args(argv)
    source = os.environ.get("HOROVOD_SOURCE")
    if not source:
        print("HOROVOD_SOURCE is not set (a horovod/horovod checkout): Horovod's suite skipped")
        return 0
    if not os.path.isfile(os.path.join(source, SUITE)):
        raise SystemExit(f"HOROVOD_SOURCE={source}: no {SUITE} there")
    mpiexec = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable),
                                                        "mpiexec")
    names = [n for n in test_names(os.path.join(source, SUITE))
             if n not in OUT_OF_SCOPE and (args.k is None or args.k in n)]
    log = open(args.log, "w") if args.log else None
    failed_any = False
    for size in [int(s) for s in args.sizes.split(",")]:
        counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
        skipped_here = [n for n in names if size in OUT_OF_SCOPE_AT.get(n, ((),))[0]]
        for name in names:
            if name in skipped_here:
                continue
            result, output = run_one(source, name, size, args.timeout, mpiexec)
            counts[result] += 1
            if result == "failed":
                failures.append(name)
                if log:
                    log.write(f"===== N={size} {name}\n{output}\n")
                    log.flush()
        failed_any = failed_any or bool(failures)
        print(f"N={size}: {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['skipped']} skipped ({len(OUT_OF_SCOPE) + len(skipped_here)} out of "
              f"scope, not run)",
              flush=True)
        for name in failures:
            print(f"  failed: {name}", flush=True)
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
