"""Files the job did not write, under ``mpiexec -n 2`` and ``-n 3``: a checkpoint folder holding
a FIFO or forged checkpoints (the checksum is a plain SHA-256 anyone can recompute), data files
whose headers lie, NaN in the data or in a checkpoint's parameters, a symbolic link at
--metrics-json. Each ends in one line: a warning and a resume from the checkpoint before, or an
error and exit code 2 on every rank -- never a traceback, an abort or a hang (every job runs
under ``timeout``). Every hostile file is made here, small.
"""
import gzip
import hashlib
import json
import os
import struct

import numpy as np
import pytest

from tests.support.launch import run_mpitrain

TINY = ["--dataset", "synthetic", "--synthetic-samples", "192", "--hidden", "16",
        "--batch-size", "4", "--no-progress"]


def _one_error_line(p, needle):
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpitrain: error: "), p.stderr[-3000:]
    assert needle in lines[0], lines[0]
    return lines[0]


def _checkpoints(tmp_path, n):
    """A folder with the checkpoints of steps 2 and 4 of a job on ``n`` ranks."""
    ck = tmp_path / "ck"
    run_mpitrain(n, [*TINY, "--steps", "4", "--checkpoint-every", "2", "--checkpoint-dir",
                     str(ck)], cwd=tmp_path)
    assert sorted(os.listdir(ck)) == ["ckpt-00000002.npz", "ckpt-00000004.npz"]
    return ck


def _forge(path, meta=None, **arrays):
    """Rewrite checkpoint ``path`` with ``meta`` keys changed and ``arrays`` replaced, its
    checksum recomputed as the format's docstring defines it."""
    with np.load(path, allow_pickle=False) as z:
        entries = {k: z[k] for k in z.files if k != "__checksum__"}
    record = json.loads(str(entries["__meta__"]))
    record.update(meta or {})
    entries["__meta__"] = np.array(json.dumps(record))
    entries.update(arrays)
    h = hashlib.sha256()
    for key in sorted(entries):
        a = np.ascontiguousarray(entries[key])
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    entries["__checksum__"] = np.array(h.hexdigest())
    np.savez(path, **entries)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("forgery", [{"epoch_position_samples": -8}, {"step": "4"},
                                     {"optimizer_layout": {"array": "param/0.weight"}}])
def test_a_forged_newest_checkpoint_is_skipped_for_the_one_before(tmp_path, n, forgery):
    ck = _checkpoints(tmp_path, n)
    newest = ck / "ckpt-00000004.npz"
    _forge(newest, forgery)
    p = run_mpitrain(n, [*TINY, "--steps", "6", "--checkpoint-dir", str(ck), "--resume"],
                     cwd=tmp_path)
    warnings = [line for line in p.stderr.splitlines() if line.startswith("mpitrain: warning")]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"mpitrain: warning: skipping {newest}: damaged __meta__: "), p.stderr
    assert "Traceback" not in p.stderr
    assert f"resumed from {ck / 'ckpt-00000002.npz'} at step 2" in p.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_a_fifo_and_a_tiny_file_claiming_100_gib_do_not_stop_a_resume(tmp_path, n):
    ck = _checkpoints(tmp_path, n)
    os.mkfifo(ck / "ckpt-00000009.npz")                 # would block open() for ever
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (26843545600,), }"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header) + 1) + header.encode() + b"\n"
    import zipfile
    with zipfile.ZipFile(ck / "ckpt-00000008.npz", "w") as zf:
        zf.writestr("__meta__.npy", npy)
        zf.writestr("__checksum__.npy", b"")
    assert (ck / "ckpt-00000008.npz").stat().st_size < 400
    p = run_mpitrain(n, [*TINY, "--steps", "6", "--checkpoint-dir", str(ck), "--resume"],
                     cwd=tmp_path, timeout_s=90)
    assert "Traceback" not in p.stderr
    assert f"resumed from {ck / 'ckpt-00000004.npz'} at step 4" in p.stdout
    warnings = [line for line in p.stderr.splitlines() if line.startswith("mpitrain: warning")]
    assert warnings == [f"mpitrain: warning: skipping {ck / 'ckpt-00000008.npz'}: member "
                        f"__meta__.npy: its header says (26843545600,) float32 (107374182400 "
                        f"bytes) but the member holds 0"], p.stderr


def _npy_bytes(shape, body=b"", descr="<f4"):
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + body


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", ["huge shape", "negative dim", "label 10^9"])
def test_an_npz_whose_header_lies_is_one_line_exit_2(tmp_path, n, case):
    x = np.random.default_rng(0).standard_normal((60, 784)).astype(np.float32)
    y = np.arange(60) % 3
    folder = tmp_path / "data"
    folder.mkdir()
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    if case == "huge shape":
        (folder / "x.npy").write_bytes(_npy_bytes((2**32, 2**32), x.tobytes()))
        needle = "truncated: its header says (4294967296, 4294967296) float32"
    elif case == "negative dim":
        (folder / "x.npy").write_bytes(_npy_bytes((-60, 784), x.tobytes()))
        needle = "its header has a negative dimension (-60, 784)"
    else:
        y[7] = 10**9
        np.save(folder / "y.npy", y)
        needle = "label 1000000000 is too large"
    p = run_mpitrain(n, ["--dataset", f"npz:{folder}", "--hidden", "16", "--batch-size", "4",
                         "--steps", "2", "--no-progress"], cwd=tmp_path, ok=False)
    _one_error_line(p, needle)


def _idx(array):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


@pytest.mark.parametrize("n", [2, 3])
def test_a_gzip_idx_that_inflates_past_its_header_is_one_line_exit_2(tmp_path, n):
    """A 64 KB gzip whose header declares 8 images but that inflates to 64 MiB: every rank
    stops one byte after the 8 images, none inflates the rest."""
    folder = tmp_path / "data"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 8), ("t10k", 4)):
        (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(rng.integers(0, 10, count)))
        (folder / f"{prefix}-images-idx3-ubyte").write_bytes(
            _idx(rng.integers(0, 255, (count, 28, 28))))
    bomb = folder / "train-images-idx3-ubyte.gz"
    (folder / "train-images-idx3-ubyte").unlink()
    with gzip.open(bomb, "wb", compresslevel=9) as g:
        g.write(_idx(np.zeros((8, 28, 28))))
        for _ in range(64):
            g.write(bytes(1 << 20))
    p = run_mpitrain(n, ["--dataset", "fashion-mnist", "--data-dir", str(folder), "--hidden",
                         "16", "--batch-size", "2", "--steps", "2", "--no-progress"],
                     cwd=tmp_path, ok=False)
    _one_error_line(p, f"{bomb}: has trailing bytes: header says 8x28x28 uint8")


@pytest.mark.parametrize("n", [2, 3])
def test_nan_in_the_data_stops_the_job_after_three_steps_with_one_line(tmp_path, n):
    """NaN images give a NaN loss from the first step: the job stops after the third, on every
    rank alike (exit 2), instead of ending with "test loss nan" and exit code 0;
    --nonfinite-steps 0 trains on as before."""
    x = np.full((120, 784), np.nan, np.float32)
    y = np.arange(120) % 3
    np.savez(tmp_path / "nan.npz", x=x, y=y)
    flags = ["--dataset", f"npz:{tmp_path / 'nan.npz'}", "--hidden", "16", "--batch-size", "4",
             "--steps", "8", "--no-progress"]
    metrics = tmp_path / "m.jsonl"
    p = run_mpitrain(n, [*flags, "--metrics-json", str(metrics)], cwd=tmp_path, ok=False)
    _one_error_line(p, "the training loss is NaN or infinite on some rank at 3 steps in a "
                       "row, up to step 3")
    assert "summary" not in metrics.read_text()
    p = run_mpitrain(n, [*flags, "--nonfinite-steps", "0"], cwd=tmp_path)
    assert "test loss nan" in p.stdout


def test_nan_in_a_resumed_checkpoint_stops_the_job_at_once_with_k_1(tmp_path):
    ck = _checkpoints(tmp_path, 2)
    newest = ck / "ckpt-00000004.npz"
    with np.load(newest, allow_pickle=False) as z:
        weight = np.full_like(z["param/0.weight"], np.inf)
    _forge(newest, **{"param/0.weight": weight})
    p = run_mpitrain(2, [*TINY, "--steps", "8", "--checkpoint-dir", str(ck), "--resume",
                         "--nonfinite-steps", "1"], cwd=tmp_path, ok=False)
    _one_error_line(p, "the training loss is NaN or infinite on some rank at step 5;")
    assert sorted(os.listdir(ck)) == ["ckpt-00000002.npz", "ckpt-00000004.npz"]


@pytest.mark.parametrize("env", [{"MPITRAIN_LR": "inf"}, {"MPITRAIN_WEIGHT_DECAY": "inf"},
                                 {"MPITRAIN_WARMUP_EPOCHS": "-inf"}])
def test_an_infinite_hyper_parameter_from_the_environment_is_one_line(tmp_path, env):
    import subprocess
    import sys
    from tests.support.launch import MPIEXEC, child_env
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain",
           *TINY, "--steps", "2"]
    p = subprocess.run(cmd, cwd=tmp_path, env=child_env(**env), capture_output=True, text=True,
                       timeout=150)
    name = next(iter(env)).removeprefix("MPITRAIN_").lower().replace("_", "-")
    _one_error_line(p, f"--{name} {float(env[next(iter(env))])!r}: must be a finite number")


@pytest.mark.parametrize("resume", [False, True])
def test_a_symbolic_link_at_metrics_json_is_replaced_never_written_through(tmp_path, resume):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    metrics = tmp_path / "m.jsonl"
    flags = [*TINY, "--checkpoint-dir", str(tmp_path / "ck")]
    if resume:
        run_mpitrain(2, [*flags, "--steps", "2"], cwd=tmp_path)
        flags += ["--resume"]
    metrics.symlink_to(target)
    run_mpitrain(2, [*flags, "--steps", "4", "--metrics-json", str(metrics)], cwd=tmp_path)
    assert target.read_text() == "keep me\n"
    assert not metrics.is_symlink()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["event"] == "summary"
