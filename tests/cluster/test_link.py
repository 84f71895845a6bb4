"""What crosses the link between two namespace hosts, and how fast (tests/support/netns_hosts.py).

The ranks read their host's eth0 counter around the allreduces: a ring allreduce must put
2(N-1)/N of the buffer on the wire per rank (within 10%: TCP/IP headers and the receiver's
acknowledgements ride on the same counter). With 2 hosts x 2 ranks the flat ring crosses the
link at two of its four edges, so each host sends what one rank of the ring sends, 1.5 buffers;
the hierarchical allreduce sends only its cross-node step, L chunks of n/L each: 1 buffer.
Shaped with a token bucket, the time of a large allreduce is the bytes on the link over the
rate, as the alpha-beta model says (alpha measured on the unshaped link).
"""
import json
import re
import sys
import textwrap

import pytest

LIMIT_S = 120
MB = 1 << 20
SCRIPT = textwrap.dedent("""
    import json, socket, sys, time
    import numpy as np
    from mpi4py import MPI
    import mpitrain as mt
    mt.init()
    nbytes, reps = int(sys.argv[1]), int(sys.argv[2])
    comm = MPI.COMM_WORLD
    x = np.full(nbytes // 4, comm.rank + 1, np.float32)
    expected = sum(range(1, comm.size + 1))

    def tx():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    y = mt.allreduce(x, op=mt.Sum)                       # warm-up: connections, buffers
    assert np.all(y == expected), "allreduce result differs"
    comm.Barrier()
    sent0 = tx()
    comm.Barrier()                                       # nobody sends before sent0 is read
    t0 = time.perf_counter()
    for _ in range(reps):
        mt.allreduce(x, op=mt.Sum)
    comm.Barrier()
    seconds = (time.perf_counter() - t0) / reps
    sent = (tx() - sent0) / reps
    comm.Barrier()
    if mt.local_rank() == 0:
        print(json.dumps({"host": socket.gethostname(), "sent": sent, "seconds": seconds,
                          "local_size": mt.local_size(), "cross_size": mt.cross_size()}),
              flush=True)
""")


def measure(cluster, tmp_path, hosts, n, nbytes, reps=3, hierarchical=False):
    """{host: {"sent": bytes per allreduce on its eth0, "seconds": ..., ...}}."""
    script = tmp_path / "link.py"
    script.write_text(SCRIPT)
    env = {"MPITRAIN_ALLREDUCE": "ring",
           "MPITRAIN_HIERARCHICAL_ALLREDUCE": "1" if hierarchical else "0"}
    p = cluster.launch(hosts, n, [sys.executable, str(script), str(nbytes), str(reps)],
                       env=env, timeout_s=LIMIT_S, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    # hydra forwards each rank's output as it comes: two ranks' lines may run together
    rows = [json.loads(text) for text in re.findall(r"\{[^{}]*\}", p.stdout)]
    return {row["host"]: row for row in rows}


@pytest.mark.timeout(LIMIT_S + 60)
def test_the_ring_sends_its_share_of_the_buffer_across_the_link(link, tmp_path):
    nbytes = 8 * MB
    one = measure(link, tmp_path, "host1:1,host2:1", 2, nbytes)
    assert sorted(one) == ["host1", "host2"]
    for host, row in one.items():
        assert (row["cross_size"], row["local_size"]) == (2, 1)
        share = 2 * (2 - 1) / 2 * nbytes
        assert share <= row["sent"] <= 1.1 * share, (host, row["sent"] / nbytes)


@pytest.mark.timeout(LIMIT_S + 60)
def test_hierarchical_sends_less_across_the_link_than_the_flat_ring(link, tmp_path):
    nbytes = 8 * MB
    flat = measure(link, tmp_path, "host1:2,host2:2", 4, nbytes)
    hier = measure(link, tmp_path, "host1:2,host2:2", 4, nbytes, hierarchical=True)
    for host in ("host1", "host2"):
        assert (flat[host]["cross_size"], flat[host]["local_size"]) == (2, 2)
        # flat: the one rank of this host whose ring neighbour is on the other host sends
        # 2(N-1)/N of the buffer; hierarchical: L ranks each send 2(M-1)/M of n/L
        assert 1.5 * nbytes <= flat[host]["sent"] <= 1.1 * 1.5 * nbytes, flat[host]
        assert 1.0 * nbytes <= hier[host]["sent"] <= 1.1 * 1.0 * nbytes, hier[host]


@pytest.mark.timeout(3 * LIMIT_S)
def test_a_shaped_link_slows_the_allreduce_as_the_model_predicts(link, tmp_path):
    rate_bits = 200e6
    small = measure(link, tmp_path, "host1:1,host2:1", 2, 4096, reps=20)
    alpha = max(row["seconds"] for row in small.values()) / (2 * (2 - 1))   # 2(N-1) messages
    link.shape(rate="200mbit")
    big = 8 * MB
    for hosts, n, hierarchical in (("host1:1,host2:1", 2, False),
                                   ("host1:2,host2:2", 4, False),
                                   ("host1:2,host2:2", 4, True)):
        rows = measure(link, tmp_path, hosts, n, big, reps=2, hierarchical=hierarchical)
        seconds = max(row["seconds"] for row in rows.values())
        on_link = max(row["sent"] for row in rows.values())          # bytes, headers included
        predicted = 2 * (n - 1) * alpha + on_link * 8 / rate_bits
        assert 0.9 * predicted <= seconds <= 1.3 * predicted, (hosts, hierarchical, seconds,
                                                                predicted)
