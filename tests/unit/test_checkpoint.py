"""checkpoint.py: round trip without pickle, checksum, atomic write, keep-last, newest valid."""
import json
import os

import numpy as np
import pytest

from mpitrain import checkpoint as ck


def _state(seed=0):
    rng = np.random.default_rng(seed)
    params = {"0.weight": rng.standard_normal((4, 3)).astype(np.float32),
              "0.bias": rng.standard_normal(4).astype(np.float32)}
    opt = {"lr": 0.1, "step": 7, "betas": (0.9, 0.999), "nesterov": False, "name": "sgd",
           "extra": None,
           "state": {"0.weight": {"buf": rng.standard_normal((4, 3))},
                     3: [np.arange(5, dtype=np.int64), np.float64(2.5)]}}
    return params, opt


def test_round_trip_is_exact(tmp_path):
    params, opt = _state()
    path = ck.save(tmp_path, 12, params, opt, {"model": "mlp", "epoch": 1})
    assert os.path.basename(path) == "ckpt-00000012.npz"
    got = ck.load(path)
    assert got.step == 12 and got.meta["model"] == "mlp" and got.meta["epoch"] == 1
    assert list(got.params) == ["0.weight", "0.bias"]
    for name in params:
        assert got.params[name].dtype == params[name].dtype
        np.testing.assert_array_equal(got.params[name], params[name])
    o = got.optimizer_state
    assert (o["lr"], o["step"], o["betas"], o["nesterov"], o["name"], o["extra"]) == \
        (0.1, 7, (0.9, 0.999), False, "sgd", None)
    np.testing.assert_array_equal(o["state"]["0.weight"]["buf"], opt["state"]["0.weight"]["buf"])
    np.testing.assert_array_equal(o["state"][3][0], np.arange(5))
    assert o["state"][3][1] == 2.5


def test_file_loads_without_pickle_and_holds_no_rank(tmp_path):
    params, opt = _state()
    path = ck.save(tmp_path, 1, params, opt, {"model": "mlp"})
    with np.load(path, allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
        meta = json.loads(str(z["__meta__"]))
    assert "rank" not in json.dumps(meta)


def test_corrupt_file_is_rejected_by_checksum(tmp_path):
    params, opt = _state()
    good = ck.save(tmp_path, 1, params, opt, {"model": "mlp"})
    params["0.bias"][0] += 1
    bad_arrays = {f"param/{k}": v for k, v in params.items()}
    with np.load(good, allow_pickle=False) as z:
        bad_arrays.update({k: z[k] for k in z.files if not k.startswith("param/")})
    bad = tmp_path / "ckpt-00000002.npz"
    np.savez(bad, **bad_arrays)
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        ck.load(bad)


def test_truncated_and_foreign_files_are_one_line_errors(tmp_path):
    params, opt = _state()
    path = ck.save(tmp_path, 3, params, opt, {})
    data = open(path, "rb").read()
    trunc = tmp_path / "ckpt-00000004.npz"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(trunc)
    assert "\n" not in str(info.value) and str(trunc) in str(info.value)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, a=np.zeros(2))
    with pytest.raises(ck.CheckpointError, match="not an mpitrain checkpoint"):
        ck.load(foreign)


def test_load_latest_skips_damaged_newest(tmp_path):
    params, opt = _state()
    ck.save(tmp_path, 5, params, opt, {"tag": "five"})
    ck.save(tmp_path, 9, params, opt, {"tag": "nine"})
    (tmp_path / "ckpt-00000011.npz").write_bytes(b"garbage")
    got, skipped = ck.load_latest(tmp_path)
    assert got.meta["tag"] == "nine" and len(skipped) == 1


def test_load_latest_empty_and_all_bad(tmp_path):
    assert ck.load_latest(tmp_path / "missing") == (None, [])
    (tmp_path / "ckpt-00000001.npz").write_bytes(b"garbage")
    with pytest.raises(ck.CheckpointError, match="no valid checkpoint"):
        ck.load_latest(tmp_path)


def test_keeps_only_the_last_few_and_leaves_no_temp_files(tmp_path):
    params, opt = _state()
    for step in range(1, 7):
        ck.save(tmp_path, step, params, opt, {}, keep=3)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [4, 5, 6]
    assert sorted(os.listdir(tmp_path)) == [f"ckpt-0000000{s}.npz" for s in (4, 5, 6)]


def test_failed_write_leaves_old_file_intact(tmp_path, monkeypatch):
    params, opt = _state()
    path = ck.save(tmp_path, 1, params, opt, {"tag": "old"})

    def boom(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.atomic_savez(path, {"x": np.zeros(1)})
    assert ck.load(path).meta["tag"] == "old"
    assert os.listdir(tmp_path) == [os.path.basename(path)]
