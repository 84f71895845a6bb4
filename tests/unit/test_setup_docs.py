"""The first five minutes: `make run` installs what running needs, the README gives the two
set-up commands, and the set-up page (docs/install.md) says how to use the venv, which launcher
its mpi4py talks to, and how to switch to a system MPI."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
SETUP = (REPO / "docs" / "install.md").read_text()


def _dry_run(target):
    """The commands ``make target`` would run from nothing (-B: as if nothing were built)."""
    return subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True,
                          text=True, timeout=60).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_run_installs_only_what_running_needs():
    run, test = _dry_run("run"), _dry_run("test")
    assert "-e '.[mpich]'" in run and ".[test" not in run and "tensorflow" not in run
    assert "-e '.[test,tensorflow]'" in test


def test_the_readme_gives_the_two_set_up_commands():
    setup = README[README.index("## Set up"):README.index("## Quick start")]
    assert "make run" in setup and "make test" in setup
    assert "](docs/install.md)" in setup


def test_the_set_up_page_says_how_to_use_the_venv_and_the_mpi_it_talks_to():
    setup = SETUP
    assert "source .venv/bin/activate" in setup
    assert ".venv/bin/mpiexec" in setup
    assert "PMIx" in setup and "pip install --no-binary mpi4py mpi4py" in setup
    assert "make test MPIEXEC=" in setup
    assert re.search(r"`make test` takes about \d+ minutes", setup)
