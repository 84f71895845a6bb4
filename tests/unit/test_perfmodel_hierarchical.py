"""The flat vs hierarchical allreduce model (benchmarks/perfmodel_lib/hierarchical.py)."""
import numpy as np
import pytest

from perfmodel_lib.hierarchical import compare, flat_time, hierarchical_time, main

INTRA = {"alpha": 5e-6, "beta": 1 / 5e9}          # 5 GB/s, 5 us
INTER = {"alpha": 50e-6, "beta": 1 / 1e9}         # 1 GB/s, 50 us


def test_formulas_by_hand_at_two_nodes_of_two():
    n = 1 << 25
    # flat: 2(N-1) steps of the slower link, each a chunk n/N
    assert flat_time(n, 2, 2, INTRA, INTER) == pytest.approx(6 * (50e-6 + n / 4 / 1e9))
    # inside: 2 steps of n/2 at 5 GB/s; across: 2 latencies + n bytes through the node's link
    assert hierarchical_time(n, 2, 2, INTRA, INTER) == pytest.approx(
        2 * (5e-6 + n / 2 / 5e9) + 2 * 50e-6 + n / 1e9)


def test_one_level_is_the_flat_ring():
    for nodes, per_node in ((1, 8), (8, 1)):
        n = np.array([0, 4096, 1 << 20])
        np.testing.assert_allclose(hierarchical_time(n, nodes, per_node, INTRA, INTER),
                                   flat_time(n, nodes, per_node, INTRA, INTER))
    assert flat_time(1 << 20, 1, 1, INTRA, INTER) == 0


def test_hierarchical_wins_on_a_slow_network_and_loses_when_the_node_is_no_faster():
    fast = {"alpha": 1e-6, "beta": 1 / 100e9}           # NVLink-like inside the node
    rows = compare([4096, 1 << 20, 1 << 26], 16, 8, fast, INTER, gamma=1e-10)
    assert all(r["speedup"] > 1 for r in rows)
    assert rows[0]["speedup"] > rows[-1]["speedup"]     # latency: 2(M-1) instead of 2(N-1)
    # large buffers through one shared link save only 2(N-1)/N - 2(M-1)/M of n: the extra
    # 2(L-1)/L n at 5 GB/s inside the node costs more than that
    assert compare([1 << 26], 16, 8, INTRA, INTER)[0]["speedup"] < 1
    same = compare([1 << 26], 2, 2, INTER, INTER)       # intra as slow as inter
    assert same[0]["speedup"] < 1


def test_a_link_per_stream_divides_the_cross_node_bytes():
    shared = hierarchical_time(1 << 26, 4, 4, INTRA, INTER)
    own = hierarchical_time(1 << 26, 4, 4, INTRA, INTER, shared_link=False)
    assert shared - own == pytest.approx(2 * 3 / 4 * (1 << 26) / 4 * 3 / 1e9)


def test_cli_prints_the_table_and_bad_input_is_one_line(capsys):
    assert main(["--nodes", "2", "--per-node", "2", "--intra", "5GB/s,5us", "--inter",
                 "1GB/s,50us", "--sizes", "4K,32M"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["bytes", "flat", "ms", "hier", "ms", "flat/hier"]
    assert [line.split()[0] for line in out[2:]] == ["4096", "33554432"]
    assert main(["--nodes", "2", "--per-node", "2", "--intra", "fast", "--inter",
                 "1GB/s,50us"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("perfmodel_lib.hierarchical: --link 'fast'")
