"""Run Horovod's own ``test/parallel/test_torch.py`` against mpitrain.torch.

    python -m tests.horovod_suite.run [--sizes 1,2,3] [--one-job] [-k WORD] [--log FILE]

The suite is the copy kept in ``upstream/`` (Horovod at commit 2626dc87, unchanged: NOTICE),
or a checkout of github.com/horovod/horovod named by HOROVOD_SOURCE. The copy's files end in
``.vendored`` so that no tool takes them for this repository's code (pyflakes, pytest's
collection); they are laid out as a checkout in a temporary folder to run.
horovod_shim.py makes ``horovod.torch`` mpitrain.torch. The tests tests/support/horovod_scope.py lists for
a number of ranks (docs/pytorch.md, "Horovod's own test suite") are not run.

Two ways to run, for each N of ``--sizes``, each job under a timeout:
- ``--one-job`` (``make test``): the whole file in one ``mpiexec -n N python -m pytest``
  job, the tests out of scope marked skipped; a failure on any rank aborts the job (the
  ranks would be out of step for every later test) and fails the run;
- otherwise one job per test: slower (a job's start is most of a test's time), but every test
  gets its verdict, for finding what fails.
A test passes when it passes on every rank, is skipped when no rank fails and some skip;
anything else (a failure on any rank, a non-zero exit, the timeout) is a failure. Prints the
counts per N and the failures; exits 1 when any test failed.
"""
import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SUITE = os.path.join("test", "parallel", "test_torch.py")
VENDORED = os.path.join(HERE, "upstream")
FILES = (SUITE, os.path.join("test", "utils", "common.py"))

from tests.support.horovod_scope import why_not


def test_names(path):
    """The TorchTests methods named test_*, in file order (read, not imported)."""
    tree = ast.parse(open(path).read(), path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TorchTests":
            return [f.name for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")]
    raise SystemExit(f"{path}: no TorchTests class")


def lay_out(folder):
    """The kept copy as a checkout under ``folder`` (test/parallel, test/utils); ``folder``."""
    for name in FILES:
        os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
        shutil.copyfile(os.path.join(VENDORED, name + ".vendored"), os.path.join(folder, name))
    return folder


def verdicts(folder, size, rc):
    """{test name: 'passed', 'skipped' or 'failed'} from every rank's outcome lines and the
    exit status. A test some rank reported and another did not is failed; one no rank reported
    is missing (not reached, where the job ended early)."""
    outcomes = {}
    for r in range(size):
        try:
            with open(os.path.join(folder, f"rank{r}.txt")) as f:
                lines = [line.split() for line in f if line.strip()]
        except FileNotFoundError:
            return {}                              # a rank never reported
        mine = {}
        for outcome, _, nodeid in lines:
            mine.setdefault(nodeid.rsplit("::", 1)[-1], []).append(outcome)
        for name, seen in mine.items():
            outcomes.setdefault(name, []).append(seen)
    result = {}
    for name, per_rank in outcomes.items():
        seen = [o for rank in per_rank for o in rank]
        if len(per_rank) < size or "failed" in seen:
            result[name] = "failed"
        else:
            result[name] = "skipped" if "skipped" in seen else "passed"
    if rc != 0 and not any(v == "failed" for v in result.values()):
        result["(the job)"] = "failed"              # it failed outside any test
    return result


def run_job(source, size, timeout, mpiexec, test=None):
    """One mpiexec job: the file (or one test of it) on ``size`` ranks; (verdicts, output)."""
    suite = os.path.join(source, SUITE)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, REPO] + [p for p in [os.environ.get(
                   "PYTHONPATH")] if p]))
    with tempfile.TemporaryDirectory() as folder:
        env["HOROVOD_SUITE_RESULTS"] = folder
        cmd = ["timeout", "-k", "5", str(timeout), mpiexec, "-n", str(size), sys.executable,
               "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "horovod_shim",
               "-o", "timeout=300", suite if test is None else f"{suite}::TorchTests::{test}"]
        proc = subprocess.run(cmd, env=env, cwd=os.path.join(source, "test"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return verdicts(folder, size, proc.returncode), proc.stdout


def run_size(source, names, size, args, mpiexec, log):
    """Every test of ``names`` at ``size`` ranks; the names of those that failed."""
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0, "not reached": 0}, []
    here = [n for n in names if why_not(n, size) is None]
    if args.one_job:
        got, output = run_job(source, size, args.timeout, mpiexec)
        results = [(n, got.get(n, "not reached")) for n in here]
        if args.verbose or any(v == "failed" for v in got.values()) or len(got) < len(here):
            print(output[-30000:], flush=True)     # pytest's report, and the failing rank's
        results += [(n, v) for n, v in got.items() if n == "(the job)"]
        outputs = {n: output for n, _ in results}
    else:
        results, outputs = [], {}
        for name in here:
            got, outputs[name] = run_job(source, size, args.timeout, mpiexec, test=name)
            results.append((name, got.get(name, "failed") if len(got) <= 1 else "failed"))
    for name, result in results:
        counts[result] += 1
        if result == "failed":
            failures.append(name)
    if log and failures:
        for name in (failures[:1] if args.one_job else failures):
            log.write(f"===== N={size} {name}\n{outputs[name]}\n")
        log.flush()
    missed = (f", {counts['not reached']} not reached (the job ended)"
              if counts["not reached"] else "")
    print(f"N={size}: {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped{missed} ({len(names) - len(here)} out of scope, "
          f"not run)", flush=True)
    for name in failures:
        print(f"  failed: {name}", flush=True)
    return failures or counts["not reached"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,3", help="numbers of ranks (default 1,2,3)")
    parser.add_argument("--one-job", action="store_true",
                        help="the whole file in one mpiexec job per N (make test)")
    parser.add_argument("-k", default=None, help="only tests whose name contains this "
                                                 "(one job per test)")
    parser.add_argument("--timeout", type=int, default=None,
                        help="seconds per job (default 180 per test, 600 for --one-job)")
    parser.add_argument("--log", default=None, help="write the failures' output here")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print pytest's report of each --one-job job (printed anyway "
                             "when it fails)")
    args = parser.parse_args(argv)
    if args.one_job and args.k:
        parser.error("-k runs one job per test; leave out --one-job")
    if args.timeout is None:
        args.timeout = 600 if args.one_job else 180
    mpiexec = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable),
                                                        "mpiexec")
    log = open(args.log, "w") if args.log else None
    with tempfile.TemporaryDirectory() as folder:
        source = os.environ.get("HOROVOD_SOURCE") or lay_out(folder)
        if not os.path.isfile(os.path.join(source, SUITE)):
            raise SystemExit(f"HOROVOD_SOURCE={source}: no {SUITE} there")
        names = [n for n in test_names(os.path.join(source, SUITE))
                 if args.k is None or args.k in n]
        failed = False
        for size in [int(s) for s in args.sizes.split(",")]:
            failed = bool(run_size(source, names, size, args, mpiexec, log)) or failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
