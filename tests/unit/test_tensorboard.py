"""TensorBoard: scalars and metrics records written through tensorboardX, read back from the
event file (TFRecord framing parsed here, both CRCs checked, events decoded with tensorboardX's
protos)."""
import numpy as np
import pytest

from mpitrain.runtime.errors import UsageError
from mpitrain.train import tensorboard
from mpitrain.train.tensorboard import TensorBoard
from tests.support.tensorboard_events import read_scalars


def test_scalars_and_records_read_back(tmp_path):
    pytest.importorskip("tensorboardX")
    logdir = str(tmp_path / "tb")
    board = TensorBoard(logdir)
    board.scalar("custom/x", 0.5, 0)
    board.scalar("custom/x", np.float32(-1.25), np.int64(3))
    tags = board.write({"event": "step", "step": 10, "epoch": 1, "loss": 2.3, "lr": 1e-3,
                        "grad_norm": 0.8, "tokens_per_s": 1234.0, "phase": "warmup",
                        "extra": None, "ok": True})
    assert tags == ["train/epoch", "train/loss", "train/lr", "train/grad_norm",
                    "train/tokens_per_s"]
    board.write({"event": "eval", "step": 20, "test_loss": 1.9, "test_accuracy": 0.41})
    board.close()
    board.close()                                       # closing twice is harmless
    got = read_scalars(logdir)
    want = [("custom/x", 0.5, 0), ("custom/x", -1.25, 3), ("train/epoch", 1, 10),
            ("train/loss", 2.3, 10), ("train/lr", 1e-3, 10), ("train/grad_norm", 0.8, 10),
            ("train/tokens_per_s", 1234.0, 10), ("eval/test_loss", 1.9, 20),
            ("eval/test_accuracy", 0.41, 20)]
    assert [(t, s) for t, _, s in got] == [(t, s) for t, _, s in want]
    np.testing.assert_allclose([v for _, v, _ in got], [v for _, v, _ in want], rtol=1e-7)


def test_context_manager_and_errors(tmp_path):
    pytest.importorskip("tensorboardX")
    with TensorBoard(tmp_path) as board:
        assert board.logdir == str(tmp_path)
        with pytest.raises(ValueError, match="'a/b': value 'x' is not a real number"):
            board.scalar("a/b", "x", 1)
        with pytest.raises(ValueError, match="step -1 is not an integer >= 0"):
            board.scalar("a/b", 1.0, -1)
        with pytest.raises(ValueError, match="step 1.5"):
            board.scalar("a/b", 1.0, 1.5)
        with pytest.raises(ValueError, match="without a 'step'"):
            board.write({"event": "step", "loss": 1.0})
        board.scalar("a/b", 7.0, 2)
    assert "closed" in repr(board)
    with pytest.raises(ValueError, match="is closed"):
        board.scalar("a/b", 1.0, 3)
    assert read_scalars(str(tmp_path)) == [("a/b", 7.0, 2)]


def test_missing_package_is_one_line(monkeypatch, tmp_path):
    real = tensorboard.importlib.util.find_spec
    monkeypatch.setattr(tensorboard.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(UsageError,
                       match=r"tensorboardX package: pip install -e '\.\[tensorboard\]'") as info:
        TensorBoard(tmp_path / "never")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "never").exists()
