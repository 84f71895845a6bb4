"""mpitrainrun without MPI: hosts, the launchers' command lines, who failed, bad input."""
import pytest

from mpitrain.run import cli, engines
from mpitrain.run.hosts import (Blacklist, LaunchError, parse_hosts, parse_lines, placement,
                                read_hostfile, spell, take)


def test_hosts_in_every_spelling():
    assert parse_hosts("a:4,b:4") == [("a", 4), ("b", 4)]
    assert parse_hosts("a,b:2,a:1") == [("a", 2), ("b", 2)]       # a named twice: summed
    assert parse_lines("# cluster\nnode1 slots=2\n\nnode2:3  # fast\nnode3\n", "f") == [
        ("node1", 2), ("node2", 3), ("node3", 1)]


@pytest.mark.parametrize("text, reason", [("a:0", "slots must be >= 1"),
                                          ("a:-1", "slots must be >= 1"),
                                          ("a:x", "slots must be an integer"),
                                          ("", "no hosts"), ("a b c", "is not a host")])
def test_bad_hosts_are_one_line(text, reason):
    with pytest.raises(LaunchError, match=reason):
        parse_hosts(text) if "," in text or ":" in text or not text else parse_lines(text, "x")


def test_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("a:2\nb slots=2\n")
    assert read_hostfile(str(f)) == [("a", 2), ("b", 2)]
    with pytest.raises(LaunchError, match="--hostfile"):
        read_hostfile(str(tmp_path / "missing"))


def test_placement_take_and_blacklist():
    hosts = [("a", 2), ("b", 2)]
    assert placement(hosts, 3) == {0: "a", 1: "a", 2: "b"}
    assert take(hosts, 3) == [("a", 2), ("b", 1)]
    assert spell(take(hosts, 4)) == "a:2,b:2"
    bl = Blacklist(2)
    assert not bl.fail("b") and "b" not in bl
    assert bl.fail("b") and "b" in bl
    assert bl.usable(hosts) == [("a", 2)]


def test_mpich_command():
    argv = engines.command("mpich", 4, [("a", 2), ("b", 2)], ["python", "t.py"],
                           ["-launcher", "fork"], ["MPITRAIN_X"], "/v/mpiexec")
    assert argv == ["/v/mpiexec", "-n", "4", "-hosts", "a:2,b:2", "-launcher", "fork",
                    "python", "t.py"]
    assert engines.command("mpich", 2, None, ["p"]) == ["mpiexec", "-n", "2", "p"]


def test_openmpi_command_exports_every_variable():
    names = engines.exported_names({"MPITRAIN_SEED": "1", "HOME": "/", "MPITRAIN_LR": "2"},
                                   ["NCCL_DEBUG"])
    assert names == ["MPITRAIN_LR", "MPITRAIN_SEED", "NCCL_DEBUG"]
    argv = engines.command("openmpi", 3, [("a", 2), ("b", 1)], ["p"], ["--bind-to", "none"],
                           names, "mpirun")
    assert argv == ["mpirun", "-np", "3", "--host", "a:2,b:1", "-x", "MPITRAIN_LR", "-x",
                    "MPITRAIN_SEED", "-x", "NCCL_DEBUG", "--bind-to", "none", "p"]


def test_slurm_command():
    assert engines.command("slurm", 8, [("n1", 4), ("n2", 4)], ["p"], ["--mpi=pmi2"]) == [
        "srun", "--ntasks", "8", "--nodes", "2", "--nodelist", "n1,n2", "--distribution",
        "block", "--export", "ALL", "--kill-on-bad-exit=1", "--mpi=pmi2", "p"]
    assert engines.command("slurm", 2, None, ["p"])[:3] == ["srun", "--ntasks", "2"]


def test_detect():
    assert engines.kind_of("HYDRA build details:\n    Version: 5.0.2") == "mpich"
    assert engines.kind_of("mpirun (Open MPI) 4.1.5") == "openmpi"
    with pytest.raises(LaunchError, match="neither"):
        engines.kind_of("something else")
    with pytest.raises(LaunchError, match="--launcher 'pbs'"):
        engines.detect("pbs", "mpiexec", {})
    assert engines.detect("openmpi", "mpiexec", {}) == "openmpi"
    assert engines.detect("slurm", "mpiexec", {}) == "slurm"


def test_blame_reads_each_launchers_failure_report():
    where = placement([("a", 2), ("b", 2)], 4)
    lines = ["=   PID 27072 RUNNING AT b", "=   EXIT CODE: 9"]
    assert engines.blame(lines, where) == (["b"], [])
    assert engines.blame(["Abort(1) on node 1 (rank 1 in comm 0): application called"],
                         where) == (["a"], [1])
    assert engines.blame(["[rank 3] uncaught exception, aborting the MPI job:"],
                         where) == (["b"], [3])
    stall = ("mpitrain: stalled 4.0 s in allreduce 'x' (collective #3) on ranks [0, 1, 3]; "
             "missing ranks [2] (rank 2: not in a collective)")
    assert engines.blame([stall], where) == (["b"], [2])
    assert engines.blame(["mpirun noticed that process rank 1 with PID 0 on node n7 exited"],
                         where) == (["n7"], [1])
    assert engines.blame(["srun: error: n3: task 5: Killed"], where) == (["n3"], [5])
    assert engines.blame(["all is well"], where) == ([], [])


@pytest.mark.parametrize("argv, says", [
    (["-H", "a:0", "p"], "slots must be >= 1"),
    (["-np", "2", "--launcher", "pbs", "p"], "invalid choice: 'pbs'"),
    (["-np", "2"], "no command"),
    (["p"], "give -np N"),
    (["-np", "0", "p"], "-np 0: must be >= 1"),
    (["-np", "4", "--min-np", "5", "--max-np", "6", "p"], "must lie in"),
    (["-np", "2", "-H", "a:2", "--hostfile", "f", "p"], "not both"),
    (["-np", "2", "--host-discovery-script", "exit 3", "p"], "exit code 3"),
    (["-np", "2", "--host-discovery-script", "echo 'not a host'", "p"], "is not a host"),
    (["-np", "2", "--host-discovery-script", "true", "p"], "no hosts"),
    (["-np", "2", "-x", "SURELY_NOT_SET_ANYWHERE", "p"], "not set"),
    (["-np", "4", "-H", "a:2", "p"], "fewer than --min-np 4"),
])
def test_bad_launcher_input_is_one_line_and_exit_2(argv, says, capsys):
    assert cli.main(argv, environ={"PATH": "/usr/bin:/bin"}) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpitrainrun: error: ") and says in err, err


def test_parse_defaults_and_exports():
    s, env = cli.parse(["-H", "a:2,b:2", "-x", "FOO=1", "--mpi-args", "-launcher fork",
                        "python", "t.py", "--lr", "0.1"], {"PATH": "/bin"})
    assert (s.np, s.min_np, s.max_np) == (4, 4, 4)
    assert s.command == ["python", "t.py", "--lr", "0.1"]
    assert s.mpi_args == ["-launcher", "fork"] and s.export == ["FOO"] and env["FOO"] == "1"
    s, _ = cli.parse(["-np", "2", "--min-np", "1", "--max-np", "4", "p"], {})
    assert (s.np, s.min_np, s.max_np, s.hosts) == (2, 1, 4, None)
