"""mpitrain/info.py's report in this process (one rank): the job line, the settings it shows,
the text it prints; ``mpitrainrun --check-build`` needs no command."""
import json

from mpitrain import info
from mpitrain.run import cli
from mpitrain.runtime import env


def test_the_job_line_counts_ranks_and_hosts():
    assert info.describe_job([("a", 2), ("b", 2)]) == "4 ranks on 2 hosts: a (2), b (2)"
    assert info.describe_job([("a", 1)]) == "1 rank on 1 host: a (1)"


def test_alone_the_job_is_one_rank_on_this_host():
    hosts = info.hosts_of_job()
    assert len(hosts) == 1 and hosts[0][1] == 1


def test_set_declared_variables_are_shown_and_unknown_ones_named(monkeypatch):
    assert "MPITRAIN_FUSION_THRESHOLD" in env.known()
    monkeypatch.setenv("MPITRAIN_FUSION_THRESHOLD", "1048576")
    monkeypatch.setenv("MPITRAIN_CHECK", "  ")                      # blank: unset
    monkeypatch.setenv("MPITRAIN_NOT_A_SETTING", "1")
    report = info.report([("a", 2), ("b", 1)])
    assert report["settings"] == {"MPITRAIN_FUSION_THRESHOLD": "1048576"}
    assert [line for line in report["unknown_settings"] if "MPITRAIN_NOT_A_SETTING" in line]
    assert report["mpi"]["job"] == "3 ranks on 2 hosts: a (2), b (1)"
    assert report["comm"]["is_homogeneous"] is False
    json.dumps(report)                                               # --json can print it
    lines = info.format_report(report)
    assert "  MPITRAIN_FUSION_THRESHOLD=1048576" in lines
    assert "  (none set)" not in lines


def test_nothing_set_says_so(monkeypatch):
    for name in env.known():
        monkeypatch.delenv(name, raising=False)
    assert "  (none set)" in info.format_report(info.report([("a", 1)]))


def test_check_build_needs_no_command():
    settings, _ = cli.parse(["--check-build"], {})
    assert settings.check_build
    assert "--check-build" in cli.build_parser().format_help()
