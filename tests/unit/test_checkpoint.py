"""checkpoint.py: round trip without pickle, checksum, atomic write, keep-last, newest valid; the
collective save/load_latest of your own loop on one process (tests/mpi/test_checkpoint_loop.py:
on several)."""
import json
import os

import numpy as np
import pytest

import mpitrain as mt
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
    path = ck.write(tmp_path, 12, params, opt, {"model": "mlp", "epoch": 1})
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
    path = ck.write(tmp_path, 1, params, opt, {"model": "mlp"})
    with np.load(path, allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
        meta = json.loads(str(z["__meta__"]))
    assert "rank" not in json.dumps(meta)


def test_corrupt_file_is_rejected_by_checksum(tmp_path):
    params, opt = _state()
    good = ck.write(tmp_path, 1, params, opt, {"model": "mlp"})
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
    path = ck.write(tmp_path, 3, params, opt, {})
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
    ck.write(tmp_path, 5, params, opt, {"tag": "five"})
    ck.write(tmp_path, 9, params, opt, {"tag": "nine"})
    (tmp_path / "ckpt-00000011.npz").write_bytes(b"garbage")
    got, skipped = ck.read_latest(tmp_path)
    assert got.meta["tag"] == "nine" and len(skipped) == 1


def test_load_latest_empty_and_all_bad(tmp_path):
    assert ck.read_latest(tmp_path / "missing") == (None, [])
    (tmp_path / "ckpt-00000001.npz").write_bytes(b"garbage")
    with pytest.raises(ck.CheckpointError, match="no valid checkpoint"):
        ck.read_latest(tmp_path)


def test_keeps_only_the_last_few_and_leaves_no_temp_files(tmp_path):
    params, opt = _state()
    for step in range(1, 7):
        ck.write(tmp_path, step, params, opt, {}, keep=3)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [4, 5, 6]
    assert sorted(os.listdir(tmp_path)) == [f"ckpt-0000000{s}.npz" for s in (4, 5, 6)]


def test_failed_write_leaves_old_file_intact(tmp_path, monkeypatch):
    params, opt = _state()
    path = ck.write(tmp_path, 1, params, opt, {"tag": "old"})

    def boom(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.atomic_savez(path, {"x": np.zeros(1)})
    assert ck.load(path).meta["tag"] == "old"
    assert os.listdir(tmp_path) == [os.path.basename(path)]


@pytest.mark.parametrize("content", [b"garbage", b"", b"\x80\x04K\x01."])   # the last: a pickle
def test_a_file_that_is_not_a_zip_says_so_in_one_line(tmp_path, content):
    bad = tmp_path / "ckpt-00000001.npz"
    bad.write_bytes(content)
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(bad)
    assert str(info.value) == f"{bad}: not a .npz checkpoint (no zip header)"
    assert "pickle" not in str(info.value)


# -- the collective save / load_latest of your own loop (here on one rank) ------------------------

def _model(seed=1):
    return mt.models.mlp(in_features=12, hidden=(8,), classes=3, seed=seed)


def _trained(seed=1, steps=2, optimizer="sgd"):
    """A model and its (wrapped) optimizer after ``steps`` updates: momentum buffers not zero."""
    model = _model(seed)
    if optimizer == "sgd":
        inner = mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        inner = mt.optim.Adam(model.parameters(), lr=0.01)
    opt = mt.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    data = mt.data.synthetic(16, shape=(12,), classes=3, seed=seed)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(data.images), data.labels)
        model.backward(loss_fn.backward())
        opt.step()
    return model, opt


def _same_state(a_model, a_opt, b_model, b_opt):
    a, b = a_model.state_dict(copy=True), b_model.state_dict(copy=True)
    assert list(a) == list(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    a, b = a_opt.state_dict(), b_opt.state_dict()
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_save_then_load_latest_restores_model_optimizer_and_extra(tmp_path):
    model, opt = _trained()
    path = mt.checkpoint.save(tmp_path, model, opt, step=7,
                              extra={"epoch": np.int64(3), "note": "x", "lr": [0.1, 0.01]})
    assert os.path.basename(path) == "ckpt-00000007.npz"
    fresh, fresh_opt = _trained(seed=2, steps=1)
    meta = mt.checkpoint.load_latest(tmp_path, fresh, fresh_opt)
    assert meta == {"step": 7, "epoch": 3, "note": "x", "lr": [0.1, 0.01]}
    _same_state(model, opt, fresh, fresh_opt)
    assert fresh_opt.optimizer.steps == 2
    # the CLI's format: the user's keys sit in __meta__ beside the step, as the CLI's epoch does
    loaded = ck.load(path)
    assert loaded.meta["epoch"] == 3 and loaded.step == 7
    assert list(loaded.params) == list(model.state_dict())


def test_a_plain_optimizer_and_the_default_step(tmp_path):
    model, opt = _trained(steps=3)
    path = mt.checkpoint.save(tmp_path, model, opt.optimizer)        # unwrapped; step: its count
    assert os.path.basename(path) == "ckpt-00000003.npz"
    fresh, fresh_opt = _trained(seed=2, steps=1)
    assert mt.checkpoint.load_latest(tmp_path, fresh, fresh_opt.optimizer) == {"step": 3}
    _same_state(model, opt, fresh, fresh_opt)


def test_load_latest_of_no_checkpoint_is_none_and_touches_nothing(tmp_path):
    model, opt = _trained()
    before = model.state_dict(copy=True)
    assert mt.checkpoint.load_latest(tmp_path / "missing", model, opt) is None
    assert mt.checkpoint.load_latest(tmp_path, model, opt) is None
    for name, value in model.state_dict(copy=True).items():
        np.testing.assert_array_equal(value, before[name])


def test_load_latest_skips_a_damaged_newest_file_with_one_warning_line(tmp_path, capsys):
    model, opt = _trained()
    mt.checkpoint.save(tmp_path, model, opt, step=4, extra={"epoch": 1})
    bad = tmp_path / "ckpt-00000009.npz"
    bad.write_bytes(b"partial")
    meta = mt.checkpoint.load_latest(tmp_path, *_trained(seed=2))
    assert meta == {"step": 4, "epoch": 1}
    err = capsys.readouterr().err
    assert err == f"mpitrain: warning: skipping {bad}: not a .npz checkpoint (no zip header)\n"


def test_load_latest_of_damaged_files_only_raises(tmp_path):
    (tmp_path / "ckpt-00000002.npz").write_bytes(b"garbage")
    with pytest.raises(ck.CheckpointError, match="no valid checkpoint in .*not a .npz"):
        mt.checkpoint.load_latest(tmp_path, *_trained())


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(tmp_path):
    model, opt = _trained()
    mt.checkpoint.save(tmp_path, model, opt, step=1)
    other = mt.models.mlp(in_features=12, hidden=(5,), classes=3, seed=1)
    other_opt = mt.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ck.CheckpointError, match=r"ckpt-00000001.npz does not fit this model: "
                                                 r"state_dict\['0.weight'\] has shape"):
        mt.checkpoint.load_latest(tmp_path, other, other_opt)
    adam_model, adam = _trained(optimizer="adam")
    with pytest.raises(ck.CheckpointError, match="does not fit this optimizer: Adam state_dict "
                                                 "mismatch"):
        mt.checkpoint.load_latest(tmp_path, adam_model, adam)


def test_save_keeps_the_newest_three_by_default_or_keep(tmp_path):
    model, opt = _trained()
    for step in range(1, 6):
        mt.checkpoint.save(tmp_path / "default", model, opt, step=step)
        mt.checkpoint.save(tmp_path / "one", model, opt, step=step, keep=1)
        mt.checkpoint.save(tmp_path / "all", model, opt, step=step, keep=None)
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "default")] == [3, 4, 5]
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "one")] == [5]
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "all")] == [1, 2, 3, 4, 5]
    mt.checkpoint.save(tmp_path / "one", model, opt, step=5, keep=1)    # the same step again


def test_save_refuses_a_step_below_the_folders_newest(tmp_path):
    """keep deletes the lowest steps: a fresh run saving step 1 beside an old run's step 9 would
    lose its own checkpoint at once, and a later resume would take the old run's."""
    model, opt = _trained()
    mt.checkpoint.save(tmp_path, model, opt, step=9)
    with pytest.raises(ck.CheckpointError, match="holds ckpt-00000009.npz, newer than step 1"):
        mt.checkpoint.save(tmp_path, model, opt, step=1)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [9]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(extra={"epoch": object()}), "extra object is not JSON-able"),
    (dict(extra={"step": 3}), r"extra keys \['step'\] are the checkpoint's own"),
    (dict(extra=[1]), "extra must be a dict"),
    (dict(step=-1), "step -1 must be an integer >= 0"),
    (dict(step=2, keep=0), "keep 0 must be an integer >= 1 or None"),
])
def test_save_rejects_bad_arguments_before_writing(tmp_path, kwargs, needle):
    model, opt = _trained()
    with pytest.raises(ValueError, match=needle):
        mt.checkpoint.save(tmp_path, model, opt, **kwargs)
    assert not os.path.exists(tmp_path / "ckpt-00000002.npz")


def test_a_failed_save_is_a_checkpoint_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ck.CheckpointError, match="cannot write a checkpoint in .*file"):
        mt.checkpoint.save(blocker, *_trained(), step=1)


def test_load_latest_reads_the_clis_checkpoints(tmp_path):
    model, opt = _trained()
    meta = {"model": "mlp", "epoch": 2, "epoch_position_samples": 16}     # as train.py writes
    ck.write(tmp_path, 12, model.state_dict(copy=True), opt.state_dict(), meta)
    got = mt.checkpoint.load_latest(tmp_path, *_trained(seed=2))
    assert got == {"step": 12, "model": "mlp", "epoch": 2, "epoch_position_samples": 16}


def test_atomic_files_get_the_umask_permissions_not_the_temp_files(tmp_path):
    """A checkpoint, --save file or token cache written atomically is as readable as a file
    opened plainly: 0666 less the umask, not mkstemp's private 0600."""
    from mpitrain.runtime import atomic
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    path = atomic.write(tmp_path / "atomic", lambda f: f.write(b"x"))
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777


# -- files an attacker wrote: the checksum is a plain SHA-256 anyone can recompute ----------------

def _sha256(arrays):
    """The checksum as the module docstring defines it (name, dtype, shape, bytes), recomputed
    here as anyone can."""
    import hashlib
    h = hashlib.sha256()
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _forge(path, meta=None, text=None, **arrays):
    """Rewrite checkpoint ``path`` with ``meta`` changed (or __meta__ replaced by ``text``) and
    ``arrays`` added, its checksum recomputed: valid as far as the checksum can tell."""
    with np.load(path, allow_pickle=False) as z:
        entries = {k: z[k] for k in z.files if k != "__checksum__"}
    record = json.loads(str(entries["__meta__"]))
    record.update(meta or {})
    entries["__meta__"] = np.array(json.dumps(record) if text is None else text)
    entries.update(arrays)
    entries["__checksum__"] = np.array(_sha256(entries))
    np.savez(path, **entries)
    return path


CLI_META = {"model": "mlp", "dataset": "synthetic", "optimizer": "sgd", "seed": 0, "epoch": 1,
            "epoch_position_samples": 16}


@pytest.mark.parametrize("change, reason", [
    (dict(text="{not json"), "damaged __meta__: not JSON"),
    (dict(text="[1, 2]"), "damaged __meta__: a JSON list, not an object"),
    (dict(text="[" * 100000 + "]" * 100000), "damaged __meta__: not JSON"),
    (dict(meta={"deep": json.loads("[" * 100 + "]" * 100)}), "nested deeper than 64 levels"),
    (dict(meta={"step": "9"}), "damaged __meta__: 'step': '9' is not int"),
    (dict(meta={"step": True}), "'step': True is not int"),
    (dict(meta={"step": 4}), "'step' 4 in a file named for step 9"),
    (dict(meta={"param_names": ["0.weight", "nope"]}), "names 'nope', which the file"),
    (dict(meta={"param_names": "0.weight"}), "'param_names': '0.weight' is not list"),
    (dict(meta={"optimizer_layout": {"array": "param/0.bias"}}), "names array 'param/0.bias'"),
    (dict(meta={"optimizer_layout": {"dict": [[1]]}}), "not a list of [key, value] pairs"),
    (dict(meta={"optimizer_layout": {"list": [], "tuple": []}}), "node with keys"),
    (dict(meta={"epoch_position_samples": -16}), "'epoch_position_samples': -16 is outside"),
    (dict(meta={"epoch": 2.5}), "'epoch': 2.5 is not int"),
    (dict(meta={"hidden": "16"}), "'hidden': '16' is not list or null"),
])
def test_a_forged_meta_is_a_damaged_checkpoint_and_the_one_before_is_read(tmp_path, change,
                                                                           reason):
    from mpitrain.train.loop import META
    params, opt = _state()
    ck.write(tmp_path, 5, params, opt, dict(CLI_META, tag="five"))
    forged = _forge(ck.write(tmp_path, 9, params, opt, CLI_META), **change)
    if "meta" in change and "epoch" not in str(change) and "hidden" not in str(change):
        with pytest.raises(ck.CheckpointError) as info:     # the format's own keys, any reader
            ck.load(forged)
        assert reason in str(info.value)
    got, skipped = ck.read_latest(tmp_path, schema=META)
    assert got.meta["tag"] == "five"
    assert len(skipped) == 1 and skipped[0].startswith(f"{forged}: ") and reason in skipped[0]
    assert "\n" not in skipped[0]


def _zip(path, members, compression=None):
    """A zip of ``members`` (name -> bytes), stored unless ``compression``."""
    import zipfile
    with zipfile.ZipFile(path, "w", compression or zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _npy_header(shape, descr="<f4"):
    import io
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False,
                                               "shape": shape})
    return buf.getvalue()


def test_a_tiny_file_whose_header_claims_100_gib_is_skipped_unallocated(tmp_path):
    params, opt = _state()
    ck.write(tmp_path, 5, params, opt, {"tag": "five"})
    claim = _zip(tmp_path / "ckpt-00000009.npz",
                 {"__meta__.npy": _npy_header((25 << 30,)), "__checksum__.npy": b""})
    assert claim.stat().st_size < 400
    got, skipped = ck.read_latest(tmp_path)
    assert got.meta["tag"] == "five"
    assert skipped == [f"{claim}: member __meta__.npy: its header says ({25 << 30},) float32 "
                       f"(107374182400 bytes) but the member holds 0"]


@pytest.mark.parametrize("shape, needle", [((2**32, 2**32), "73786976294838206464 bytes"),
                                           ((-1, 4), "negative dimension (-1, 4)")])
def test_a_member_with_an_impossible_shape_is_one_line(tmp_path, shape, needle):
    bad = _zip(tmp_path / "ckpt-00000001.npz", {"param/w.npy": _npy_header(shape) + bytes(16)})
    with pytest.raises(ck.CheckpointError) as info:
        ck.load(bad)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_a_deflated_member_is_refused_without_inflating_it(tmp_path):
    """A 64 MiB member deflated into some 64 KB: refused from the zip's directory, so loading
    takes no memory and no time (a 4 MB member inflating to 4 GiB is the same file, larger)."""
    import tracemalloc
    import zipfile
    bomb = tmp_path / "ckpt-00000001.npz"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("__meta__.npy", "w") as member:
            member.write(_npy_header((16 << 20,)))
            block = bytes(1 << 20)
            for _ in range(64):
                member.write(block)
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(ck.CheckpointError, match="member __meta__.npy is compressed"):
            ck.load(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_a_fifo_named_like_a_checkpoint_is_not_listed_and_never_blocks(tmp_path):
    import threading
    params, opt = _state()
    ck.write(tmp_path, 5, params, opt, {"tag": "five"})
    fifo = tmp_path / "ckpt-00000009.npz"
    os.mkfifo(fifo)
    (tmp_path / "ckpt-00000010.npz").mkdir()            # a folder by that name: not one either
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [5]
    result = {}

    def read():
        result["latest"] = ck.read_latest(tmp_path)
        try:
            ck.load(fifo)                                  # named directly: refused at once
        except ck.CheckpointError as exc:
            result["direct"] = str(exc)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():                                 # unblock it: the old code's open()
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a folder with a FIFO in it blocked")
    got, skipped = result["latest"]
    assert got.meta["tag"] == "five" and skipped == []
    assert result["direct"] == f"{fifo}: not a regular file"
