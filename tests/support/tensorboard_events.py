"""Reading back the scalars of a TensorBoard event file: the TFRecord framing parsed here,
both CRCs checked, the events decoded with tensorboardX's protos (the test skips without it)."""
import glob
import os
import struct

import pytest


def _masked_crc(data):
    from tensorboardX.crc32c import crc32c
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(logdir):
    """[(tag, value, step)] of every scalar in the one event file in ``logdir``, in order."""
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto.event_pb2 import Event
    [path] = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    data = open(path, "rb").read()
    out, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        body = data[pos + 12:pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        assert header_crc == _masked_crc(header) and body_crc == _masked_crc(body)
        pos += 16 + length
        event = Event.FromString(body)
        for v in event.summary.value:
            out.append((v.tag, v.simple_value, event.step))
    assert pos == len(data)
    return out
