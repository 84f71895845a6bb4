"""The restart loop against a stand-in mpiexec (no MPI): restarts, MPITRAIN_RESTART_COUNT,
blacklisting, --min-np, preemption, the final line."""
import json
import os
import stat
import sys
import textwrap

from mpitrain.run import cli

FAKE = textwrap.dedent("""\
    #!{python}
    # A stand-in mpiexec: logs its argv and MPITRAIN_RESTART_COUNT, then plays the next entry
    # of the plan: [exit code, lines to print on stderr]. A probe (one rank of `true`) fails
    # on the hosts down.json lists and is not logged.
    import json, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.argv[-1] == "true":
        down = os.path.join(here, "down.json")
        host = sys.argv[sys.argv.index("-hosts") + 1].split(":")[0]
        sys.exit(os.path.exists(down) and host in json.load(open(down)))
    log = os.path.join(here, "log.jsonl")
    with open(log, "a") as f:
        f.write(json.dumps({{"argv": sys.argv[1:],
                            "restart": os.environ.get("MPITRAIN_RESTART_COUNT"),
                            "seed": os.environ.get("MPITRAIN_SEED")}}) + "\\n")
    with open(log) as f:
        n = len(f.readlines())
    plan = json.load(open(os.path.join(here, "plan.json")))
    code, lines = plan[min(n, len(plan)) - 1]
    for line in lines:
        print(line, file=sys.stderr)
    sys.exit(code)
""")


def fake_mpiexec(tmp_path, plan):
    path = tmp_path / "mpiexec"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return str(path)


def launches(tmp_path):
    return [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]


def run(tmp_path, plan, *flags):
    mpiexec = fake_mpiexec(tmp_path, plan)
    env = dict(os.environ, MPITRAIN_SEED="7")
    return cli.main(["--launcher", "mpich", "--mpiexec", mpiexec, "--restart-delay", "0",
                     *flags, "prog", "--flag"], environ=env)


def test_restarts_until_success_with_the_restart_count(tmp_path, capsys):
    assert run(tmp_path, [[1, []], [137, []], [0, []]], "-np", "2", "--max-restarts", "2") == 0
    seen = launches(tmp_path)
    assert [s["restart"] for s in seen] == ["0", "1", "2"]
    assert all(s["argv"] == ["-n", "2", "prog", "--flag"] and s["seed"] == "7" for s in seen)
    err = capsys.readouterr().err
    assert "the job failed with exit code 1; restart 1 of 2" in err
    assert "the job failed with exit code 137; restart 2 of 2" in err


def test_restarts_exhausted_is_one_final_line_with_the_jobs_code(tmp_path, capsys):
    assert run(tmp_path, [[5, []]], "-np", "2", "--max-restarts", "1") == 5
    assert len(launches(tmp_path)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("mpitrainrun: giving up: the job failed with exit code 5 after 1 restart(s) "
                    "(--max-restarts 1)")


def test_a_failing_host_is_blacklisted_and_the_job_shrinks(tmp_path, capsys):
    died = [9, ["=   PID 1234 RUNNING AT b", "=   EXIT CODE: 9"]]
    code = run(tmp_path, [died, died, [0, []]], "-H", "a:2,b:2", "--min-np", "2",
               "--max-restarts", "3", "--blacklist-after", "2", "--mpi-args", "-launcher fork")
    assert code == 0
    argv = [s["argv"] for s in launches(tmp_path)]
    assert argv[0][:4] == argv[1][:4] == ["-n", "4", "-hosts", "a:2,b:2"]
    assert argv[2] == ["-n", "2", "-hosts", "a:2", "-launcher", "fork", "prog", "--flag"]
    assert "blacklisting host b after 2 failure(s)" in capsys.readouterr().err


def test_a_host_that_cannot_start_a_rank_is_blamed_not_the_survivors(tmp_path, capsys):
    """b died whole: only a's ranks report (they crashed for the lost peers); the probe finds
    b down, so b takes the strike and the job goes on on a."""
    (tmp_path / "down.json").write_text(json.dumps(["b"]))
    died = [11, ["=   PID 1234 RUNNING AT a", "=   EXIT CODE: 11"]]
    code = run(tmp_path, [died, [0, []]], "-H", "a:2,b:2", "--min-np", "2",
               "--max-restarts", "1", "--blacklist-after", "1")
    assert code == 0
    argv = [s["argv"] for s in launches(tmp_path)]
    assert argv[1][:4] == ["-n", "2", "-hosts", "a:2"]
    err = capsys.readouterr().err
    assert "mpitrainrun: b cannot start a rank: it is taken for the failure" in err
    assert "blacklisting host b after 1 failure(s)" in err and "host a" not in err


def test_below_min_np_after_blacklisting_stops_with_one_line(tmp_path, capsys):
    died = [1, ["[rank 3] uncaught exception, aborting the MPI job:"]]
    code = run(tmp_path, [died], "-H", "a:2,b:2", "--min-np", "3", "--max-restarts", "5",
               "--blacklist-after", "1")
    assert code == 3 and len(launches(tmp_path)) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("mpitrainrun: stopping: 2 usable slot(s) on 1 host(s), fewer than --min-np 3 "
                    "(blacklisted: b)")


def test_preempted_is_not_a_failure(tmp_path, capsys):
    assert run(tmp_path, [[32, []], [0, []]], "-np", "2") == 32
    assert len(launches(tmp_path)) == 1
    assert "--restart-on-preempt restarts it" in capsys.readouterr().err
    (tmp_path / "log.jsonl").unlink()
    # restarted even with --max-restarts 0: a preemption spends no restart
    assert run(tmp_path, [[32, []], [32, []], [0, []]], "-np", "2",
               "--restart-on-preempt") == 0
    assert [s["restart"] for s in launches(tmp_path)] == ["0", "1", "2"]


def test_discovery_runs_before_every_launch(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:2\nb:2\n")
    script = f"cat {hosts}; echo launch >> {tmp_path / 'calls'}"
    died = [9, ["=   PID 1 RUNNING AT b"]]
    code = run(tmp_path, [died, [0, []]], "-np", "4", "--min-np", "1", "--max-restarts", "1",
               "--blacklist-after", "1", "--host-discovery-script", script)
    assert code == 0
    assert [s["argv"][:4] for s in launches(tmp_path)] == [["-n", "4", "-hosts", "a:2,b:2"],
                                                          ["-n", "2", "-hosts", "a:2"]]
    assert (tmp_path / "calls").read_text().count("launch") == 3     # parse + 2 launches


def test_verbose_prints_the_exact_command(tmp_path, capsys):
    assert run(tmp_path, [[0, []]], "-np", "3", "--verbose") == 0
    err = capsys.readouterr().err
    assert f"mpitrainrun: running: {tmp_path / 'mpiexec'} -n 3 prog --flag" in err
