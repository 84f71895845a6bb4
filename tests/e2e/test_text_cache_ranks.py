"""--dataset text:PATH at N = 2 and 3 with no token cache yet: the first rank of the host alone
hashes and tokenises the text while the others wait; they then adopt its validated cache and
hash nothing. A text that cannot be used is the same one line on every rank (exit 2), whichever
rank finds it.

Each rank counts, in this test's wrapper around the CLI, the tokenisations and SHA-256s the
text module starts while the datasets are built, and writes them to counts.RANK.
"""
import subprocess
import sys

import pytest

from tests.support.launch import MPIEXEC, child_env
from tests.support.texts import text_file

LIMIT_S = 150
WRAPPER = r"""
import hashlib, sys, types
from mpitrain import comm
import mpitrain.data.text as text_mod
from mpitrain.train import cli, setup
counts = {"tokenised": 0, "hashed": 0}
tokenize = text_mod._tokenize
def counted_tokenize(*args):
    counts["tokenised"] += 1
    return tokenize(*args)
def sha256(*args):
    counts["hashed"] += 1
    return hashlib.sha256(*args)
text_mod._tokenize = counted_tokenize
text_mod.hashlib = types.SimpleNamespace(sha256=sha256)
datasets = setup._text_datasets
def counted_datasets(*args):
    try:
        return datasets(*args)
    finally:
        with open(f"counts.{comm.rank()}", "w") as f:
            f.write(f"{counts['tokenised']} {counts['hashed']}")
setup._text_datasets = counted_datasets
cli.main(sys.argv[1:])
"""
GPT = ["--model", "gpt", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size",
       "16", "--eval-batches", "2", "--threads", "1", "--no-progress", "--batch-size", "2",
       "--steps", "3"]


def job(n, *flags, cwd):
    cmd = ["timeout", "-k", "5", str(LIMIT_S), MPIEXEC, "-n", str(n), sys.executable, "-c",
           WRAPPER, *GPT, *flags]
    return subprocess.run(cmd, cwd=cwd, env=child_env(XDG_CACHE_HOME=str(cwd / "xdg")),
                          capture_output=True, text=True, timeout=LIMIT_S + 30)


def counts(folder, n):
    return [tuple(map(int, (folder / f"counts.{r}").read_text().split())) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_the_first_rank_builds_the_cache_and_the_others_hash_nothing(tmp_path, n):
    text = text_file(tmp_path)
    p = job(n, "--dataset", f"text:{text}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    # rank 0: the text, the tokens as written, the tokens read back; the others: nothing
    assert counts(tmp_path, n) == [(1, 3)] + [(0, 0)] * (n - 1)
    assert (tmp_path / "story.txt.mpitrain" / "chars.npy").is_file()
    p = job(n, "--dataset", f"text:{text}", cwd=tmp_path)        # the cache exists
    assert p.returncode == 0, p.stderr[-3000:]
    assert counts(tmp_path, n) == [(0, 2)] + [(0, 0)] * (n - 1)


@pytest.mark.parametrize("n", [2, 3])
def test_a_bad_text_is_one_line_on_every_rank(tmp_path, n):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait ".encode("latin-1") * 400)
    p = job(n, "--dataset", f"text:{bad}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    line = f"mpitrain: error: {bad}: is not UTF-8 text (byte 0xe9 at offset 3); use --tokens bytes"
    assert p.stderr.strip().splitlines() == [line], p.stderr[-3000:]
    assert counts(tmp_path, n) == [(1, 1)] + [(0, 0)] * (n - 1)
