"""benchmarks/perfmodel_lib: the ring fit recovers known alpha/beta/gamma, links parse, the fusion
plan matches comm/fusion.py, predictions behave, and benchmarks/perfmodel.py runs end to end on
synthetic benchmark JSON."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "perfmodel.py"
import perfmodel_lib as pm                           # benchmarks/ is on pytest.ini's pythonpath

ALPHA, BETA, GAMMA = 20e-6, 1 / 2e9, 1 / 8e9       # 20 us, 2 GB/s link, 8 GB/s reduce
SIZES = [2 ** k for k in range(10, 25, 2)]


def synthetic(ranks=(2,), noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    ring = [(n, r, float(pm.ring_time(n, r, ALPHA, BETA, GAMMA))
             * (1 + noise * rng.standard_normal())) for r in ranks for n in SIZES]
    red = [(n, (2e-6 + n * GAMMA) * (1 + noise * rng.standard_normal())) for n in SIZES]
    return ring, red


def test_ring_formula_worked_example():
    # N=4, 1 MB: 6 alpha + 1.5 MB beta + 0.75 MB gamma.
    t = pm.ring_time(1e6, 4, 1e-5, 1e-9, 1e-10)
    assert t == pytest.approx(6e-5 + 1.5e-3 + 0.75e-4)
    assert pm.ring_time(1e6, 1, 1e-5, 1e-9, 1e-10) == 0


@pytest.mark.parametrize("ranks", [(2,), (2, 3, 4)])
def test_fit_recovers_known_parameters(ranks):
    ring, red = synthetic(ranks)
    f = pm.fit(ring, red)
    assert f["alpha"] == pytest.approx(ALPHA, rel=1e-6)
    assert f["beta"] == pytest.approx(BETA, rel=1e-6)
    assert f["gamma"] == pytest.approx(GAMMA, rel=1e-6)
    assert f["reduce_call_s"] == pytest.approx(2e-6, rel=1e-6)
    assert f["rel_rms"] < 1e-9


def test_fit_with_noise_is_close():
    ring, red = synthetic((2,), noise=0.03, seed=1)
    f = pm.fit(ring, red)
    assert f["alpha"] == pytest.approx(ALPHA, rel=0.15)
    assert f["beta"] == pytest.approx(BETA, rel=0.1)
    assert f["gamma"] == pytest.approx(GAMMA, rel=0.1)
    assert 0.005 < f["rel_rms"] < 0.1


def test_without_reduce_timings_only_the_combination_is_identified():
    ring, _ = synthetic((2, 4))
    f = pm.fit(ring)
    assert f["gamma"] is None and "only" in f["identifiable"]
    assert f["alpha"] == pytest.approx(ALPHA, rel=1e-6)
    assert f["combined"] == pytest.approx(2 * BETA + GAMMA, rel=1e-6)
    # Predictions on the measured network need nothing more.
    net = pm.network_params(f)
    assert pm.ring_time(1e6, 8, net["alpha"], net["beta"], net["gamma"]) == pytest.approx(
        pm.ring_time(1e6, 8, ALPHA, BETA, GAMMA), rel=1e-6)


def test_fit_rejects_unusable_data():
    with pytest.raises(pm.ModelError, match="one message size"):
        pm.fit([(1024, 2, 1e-4), (1024, 2, 1.1e-4)])
    with pytest.raises(pm.ModelError, match="ranks >= 2"):
        pm.fit([(1024, 1, 1e-4), (2048, 2, 1e-4)])
    with pytest.raises(pm.ModelError, match="no ring"):
        pm.fit([])


def test_nonnegative_fit_clamps_noise_below_zero():
    # Pure bandwidth data with a tiny negative intercept from noise: alpha clamps to 0.
    ring = [(n, 2, n * 1e-9 - 1e-7) for n in (1e5, 1e6, 1e7)]
    f = pm.fit(ring)
    assert f["alpha"] == 0.0 and f["combined"] > 0


def test_mpi_fit_and_threshold_dispatch():
    a_m, c_m = 3e-6, 1 / 4e9
    obs = [(n, r, float(pm.mpi_time(n, r, a_m, c_m))) for r in (2, 4, 8) for n in SIZES]
    f = pm.fit_mpi(obs)
    assert f["alpha"] == pytest.approx(a_m, rel=1e-6)
    assert f["combined"] == pytest.approx(c_m, rel=1e-6)
    assert pm.tree_steps([2, 3, 4, 1024]).tolist() == [2, 4, 4, 20]
    ring_fit = {"alpha": ALPHA, "beta": BETA, "gamma": GAMMA}
    net = pm.network_params(ring_fit, None, f, ring_threshold=1 << 20)
    assert pm.allreduce_time(2 << 20, 4, net) == pytest.approx(
        pm.ring_time(2 << 20, 4, ALPHA, BETA, GAMMA))
    assert pm.allreduce_time(1 << 19, 4, net) == pytest.approx(pm.mpi_time(1 << 19, 4, a_m, c_m))
    link = pm.network_params(ring_fit, pm.parse_link("8Gbps,10us"), f, ring_threshold=1 << 20)
    assert link["mpi_alpha"] == pytest.approx(a_m + 10e-6)
    assert link["mpi_combined"] == pytest.approx(2 / 1e9 + GAMMA)     # the link is the bottleneck
    no_mpi = pm.network_params(ring_fit)
    assert no_mpi["ring_threshold"] == 0                               # everything on the ring
    default = pm.network_params(ring_fit, None, f)          # mpitrain's own switch, by ranks
    assert pm.allreduce_time(4 << 20, 2, default) == pytest.approx(
        pm.ring_time(4 << 20, 2, ALPHA, BETA, GAMMA))                  # two ranks: from 1 MiB
    assert pm.allreduce_time(4 << 20, 4, default) == pytest.approx(
        pm.mpi_time(4 << 20, 4, a_m, c_m))                             # more: from 32 MiB
    with pytest.raises(pm.ModelError):
        pm.fit_mpi(obs[:1])


def test_parse_link():
    link = pm.parse_link("25Gbps,5us")
    assert link["alpha"] == pytest.approx(5e-6)
    assert link["beta"] == pytest.approx(8 / 25e9)
    assert pm.parse_link("3GB/s, 1.5ms")["beta"] == pytest.approx(1 / 3e9)
    assert pm.parse_link("100Gb/s,0.6us")["beta"] == pytest.approx(8 / 100e9)
    assert pm.parse_link("800Mbps,50us")["alpha"] == pytest.approx(50e-6)
    for bad in ("25Gbps", "25,5us", "fastGbps,5us", "25Gbps,5", "0Gbps,5us", "25Gbps,5us,1"):
        with pytest.raises(pm.ModelError, match="--link"):
            pm.parse_link(bad)


def test_link_network_keeps_local_software_costs():
    f = {"alpha": 10e-6, "beta": 1 / 5e9, "gamma": 1 / 8e9}
    slow = pm.network_params(f, pm.parse_link("10Gbps,5us"))
    assert slow["alpha"] == pytest.approx(15e-6) and slow["beta"] == pytest.approx(8 / 10e9)
    fast = pm.network_params(f, pm.parse_link("400Gbps,1us"))
    assert fast["beta"] == pytest.approx(1 / 5e9)          # local copies are the bottleneck
    assert fast["gamma"] == f["gamma"]


def test_fusion_buckets_match_the_fusion_plan(monkeypatch):
    fusion = pytest.importorskip("mpitrain.comm.fusion")
    sizes = [40, 4, 400, 8, 8, 100, 4]                     # float32 elements
    arrays = [np.zeros(s, np.float32) for s in sizes]
    for solo in (fusion.SOLO_BYTES, 160):                  # 160 B: the 400 and 100 go alone
        monkeypatch.setattr(fusion, "SOLO_BYTES", solo)
        monkeypatch.setattr(pm.plans, "SOLO_BYTES", solo)
        for threshold in (0, 16, 64, 500, 10_000):
            plan = fusion.FusionBuffer(threshold).plan(arrays)
            want = [(b.total * 4, len(b.entries)) for b in plan]
            assert pm.fusion_plan([s * 4 for s in sizes], threshold) == want, threshold


def test_compute_time_interpolates_and_scales():
    recs = [(32, 0.010, None, None), (64, 0.018, None, None)]
    assert pm.compute_time(recs, 64) == 0.018
    assert pm.compute_time(recs, 128) == pytest.approx(0.034)     # t = 0.002 + b/4000
    assert pm.compute_time([(64, 0.02, None, None)], 16) == pytest.approx(0.005)
    threaded = [(64, 0.02, 1, None), (64, 0.012, 2, None)]
    assert pm.compute_time(threaded, 64, threads=1) == 0.02
    assert pm.compute_time(threaded, 64, threads=2) == 0.012


def test_step_time_and_efficiency():
    net = {"name": "x", "alpha": ALPHA, "beta": BETA, "gamma": GAMMA}
    # One packed bucket of 3 tensors: pack + 1/N scale + unpack at N>1; nothing at N=1.
    plan = [(4e6, 3)]
    assert pm.step_time(0.05, plan, 1, net, mu=1e-10) == (0.05, 0.0)
    assert pm.step_time(0.05, [(4e6, 1)], 2, net, mu=1e-10)[1] == pytest.approx(
        pm.ring_time(4e6, 2, ALPHA, BETA, GAMMA) + 4e6 * 1e-10)
    st2, c2 = pm.step_time(0.05, plan, 2, net, mu=1e-10)
    assert c2 == pytest.approx(pm.ring_time(4e6, 2, ALPHA, BETA, GAMMA) + 3 * 4e6 * 1e-10)
    assert st2 == pytest.approx(0.05 + c2)
    # 4 ranks on 2 cores time-share: compute doubles.
    st4, c4 = pm.step_time(0.05, plan, 4, net, mu=0, ranks_per_node=4, cores=2)
    assert st4 == pytest.approx(0.1 + c4)
    steps = {"mlp": [(64, 0.05, None, None)]}
    proj = pm.project(["mlp"], steps, {"mlp": plan}, [net], 0.0, 64, 64)["x"]["mlp"]
    eff = np.array(proj["efficiency"])
    assert eff[0] == 1.0 and (np.diff(eff) <= 1e-12).all() and eff[-1] < eff[1]
    ideal = {"name": "ideal", "alpha": 0.0, "beta": 0.0, "gamma": 0.0}
    flat = pm.project(["mlp"], steps, {"mlp": plan}, [ideal], 0.0, 64, 8)["ideal"]["mlp"]
    assert flat["efficiency"] == [1.0] * 8


def test_validate_reports_relative_error():
    net = {"name": "local", "alpha": ALPHA, "beta": BETA, "gamma": GAMMA}
    steps = {"mlp": [(64, 0.05, None, None)]}
    exact, _ = pm.step_time(0.05, [(4e6, 1)], 2, net, 0.0, ranks_per_node=2, cores=2)
    pts = [{"model": "mlp", "ranks": 2, "per_rank_batch": 64, "step_time_ms": exact * 1e3},
           {"model": "mlp", "ranks": 1, "per_rank_batch": 64, "step_time_ms": 0.05e3 * 1.1}]
    rows = pm.validate(pts, steps, {"mlp": [(4e6, 1)]}, net, 0.0, cores=2)
    assert rows[0]["error"] == pytest.approx(0.0, abs=1e-12)
    assert rows[1]["error"] == pytest.approx(1 / 1.1 - 1)
    # Calibrated from the sweep's N=1 point: compute = 55 ms, so N=2 is predicted 5 ms slower.
    cal = pm.calibrate(pts, {"mlp": [(4e6, 1)]}, net, 0.0, cores=2)
    assert cal == {"mlp": [(64, pytest.approx(0.055), None, None)]}
    # a sweep that also has another model's points, with only mlp asked for (--model mlp)
    other = [dict(p, model="lenet") for p in pts]
    assert pm.calibrate(pts + other, {"mlp": [(4e6, 1)]}, net, 0.0, cores=2) == cal
    rows = pm.validate(pts[:1], cal, {"mlp": [(4e6, 1)]}, net, 0.0, cores=2)
    assert rows[0]["predicted_ms"] == pytest.approx(exact * 1e3 + 5.0)


def _write_inputs(tmp_path):
    ring, red = synthetic((2,))
    allreduce = {"benchmark": "allreduce", "ranks": 2,
                 "results": [{"algo": "ring", "bytes": n, "time_us": t * 1e6} for n, _, t in ring]
                 + [{"algo": "mpi", "bytes": 1024, "time_us": 1.0}],
                 "reduce_kernel": [{"bytes": n, "time_us": t * 1e6} for n, t in red]}
    step = {"results": [{"model": m, "batch": 64, "step_time_ms": ms}
                        for m, ms in (("mlp", 20.0), ("lenet", 60.0))]}
    (tmp_path / "a.json").write_text(json.dumps(allreduce))
    (tmp_path / "s.json").write_text(json.dumps(step))
    return tmp_path / "a.json", tmp_path / "s.json"


def test_loaders_read_the_documented_format(tmp_path):
    a, s = _write_inputs(tmp_path)
    got = pm.load_allreduce(a)
    ring, red = got["ring"], got["reduce"]
    assert len(ring) == len(SIZES) and all(r[1] == 2 for r in ring)   # mpi record skipped
    assert got["mpi"] == []
    f = pm.fit(ring, red)
    assert f["beta"] == pytest.approx(BETA, rel=1e-6)
    steps = pm.load_step(s)
    assert steps["lenet"] == [(64, pytest.approx(0.06), None, None)]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(pm.ModelError, match="not JSON"):
        pm.load_step(tmp_path / "bad.json")


def test_loaders_read_the_sibling_benchmarks_formats(tmp_path):
    # benchmarks/allreduce.py: "ours_s" per size; under --algo auto only sizes from the ring
    # threshold up ran the ring. benchmarks/step.py: nested best/median rounds, threads.
    ring, _ = synthetic((2,))
    doc = {"ranks": 2, "algo": "auto", "ring_threshold_bytes": 65536,
           "results": [{"bytes": n, "iters": 5, "ours_s": t, "ours_min_s": t / 2,
                        "mpi_s": 2 * t, "mpi_min_s": t} for n, _, t in ring]}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    got = pm.load_allreduce(tmp_path / "a.json")
    assert got["reduce"] is None
    assert [g[0] for g in got["ring"]] == [n for n in SIZES if n >= 65536]
    assert [g[2] for g in got["ring"]] == [t for n, _, t in ring if n >= 65536]   # medians
    assert [g[2] for g in got["mpi"]] == [2 * t for _, _, t in ring]              # all sizes
    low = pm.load_allreduce([tmp_path / "a.json"], stat="min")
    assert [g[2] for g in low["ring"]] == [t / 2 for n, _, t in ring if n >= 65536]
    (tmp_path / "r.json").write_text(json.dumps(dict(doc, algo="ring")))
    both = pm.load_allreduce([tmp_path / "a.json", tmp_path / "r.json"])
    assert len(both["ring"]) == len(got["ring"]) + len(SIZES)
    (tmp_path / "m.json").write_text(json.dumps(dict(doc, algo="mpi")))
    with pytest.raises(pm.ModelError, match="no ring timings"):
        pm.load_allreduce(tmp_path / "m.json")
    step = {"argv": [], "results": [
        {"model": "mlp", "batch": 64, "threads": t, "best": {"step_ms": ms, "fwd_ms": 1.0},
         "median": {"step_ms": ms * 1.2, "fwd_ms": 1.1}} for t, ms in ((1, 10.0), (2, 6.0))]}
    (tmp_path / "s1.json").write_text(json.dumps({"results": step["results"][:1]}))
    (tmp_path / "s2.json").write_text(json.dumps({"results": step["results"][1:]}))
    steps = pm.load_step([tmp_path / "s1.json", tmp_path / "s2.json"], "best")
    assert steps["mlp"] == [(64, pytest.approx(0.010), 1, None),
                            (64, pytest.approx(0.006), 2, None)]
    med = pm.load_step(tmp_path / "s1.json")
    assert med["mlp"][0][1] == pytest.approx(0.012)


def test_script_end_to_end(tmp_path):
    pytest.importorskip("mpitrain.nn.models")
    a, s = _write_inputs(tmp_path)
    scaling = {"mode": "weak", "points": [
        {"model": "mlp", "ranks": 1, "per_rank_batch": 64, "step_time_ms": 21.0,
         "comm_time_ms": 0.0},
        {"model": "mlp", "ranks": 2, "per_rank_batch": 64, "step_time_ms": 30.0,
         "comm_time_ms": 8.0}]}
    (tmp_path / "sc.json").write_text(json.dumps(scaling))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--allreduce", str(a), "--step", str(s),
                           "--scaling", str(tmp_path / "sc.json"), "--model", "mlp", "lenet",
                           "--link", "25Gbps,5us", "--max-ranks", "64", "--no-measure",
                           "--cores", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "alpha = 20.00 us" in proc.stdout and "25Gbps,5us" in proc.stdout
    assert "validation" in proc.stdout and "error" in proc.stdout
    doc = json.loads((out / "perfmodel.json").read_text())
    assert doc["fit"]["gamma"] == pytest.approx(GAMMA, rel=1e-6)
    effs = doc["projection"]["25Gbps,5us"]["lenet"]["efficiency"]
    assert len(effs) == 64 and effs[0] == 1.0 and effs[-1] < 1.0
    assert [r["ranks"] for r in doc["validation"]] == [1, 2]
    assert (out / "perfmodel.png").stat().st_size > 10_000
    cal = subprocess.run([sys.executable, str(SCRIPT), "--allreduce", str(a), "--step", str(s),
                          "--scaling", str(tmp_path / "sc.json"), "--model", "mlp",
                          "--compute-from", "scaling", "--fit-bytes", "65536:", "--max-ranks", "8",
                          "--no-measure", "--out", str(out), "--markdown", str(out / "pm.md")],
                         capture_output=True, text=True, timeout=240)
    assert cal.returncode == 0, cal.stderr
    doc = json.loads((out / "perfmodel.json").read_text())
    assert doc["compute_from"] == "scaling" and doc["fit"]["ring_points"] == 5
    assert [r["ranks"] for r in doc["validation"]] == [2]     # N=1 was the calibration
    md = (out / "pm.md").read_text()
    assert "| network | model | N=1 |" in md and "--compute-from scaling" in md
    bad = subprocess.run([sys.executable, str(SCRIPT), "--allreduce", str(a), "--step", str(s),
                          "--link", "fast", "--no-measure", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "perfmodel: error: --link 'fast': expected BANDWIDTH,LATENCY like 25Gbps,5us"]


# --- overlap of the allreduce with backward (the trainer's default) ------------------------------

# alpha only: every bucket's allreduce takes 2 alpha at N=2, whatever its size
SLOW = {"name": "slow", "alpha": 1e-3, "beta": 0.0, "gamma": 0.0}       # 2 ms per bucket


def test_comm_thread_runs_buckets_in_order():
    # hand-computed: b1 waits for b0 (ends 5), b2 waits for its ready time (8)
    assert pm.comm_thread([1, 2, 8], [4, 1, 1]) == ([1, 5, 8], [5, 6, 9])
    assert pm.comm_thread([], []) == ([], [])


def test_overlap_one_bucket_fully_hidden():
    # backward = 0.5 of 20 ms = 10 ms; the bucket is ready at 25% (2.5 ms), done at 4.5 ms
    plan = pm.OverlapPlan([(4e6, 1, 0.25)], backward_share=0.5)
    s = pm.overlap_schedule(0.010, plan, 2, SLOW, mu=0.0)
    assert s["ready"] == [pytest.approx(0.0025)] and s["end"] == [pytest.approx(0.0045)]
    assert s["backward_end"] == pytest.approx(0.010) and s["exposed"] == 0.0
    assert pm.step_time(0.020, plan, 2, SLOW, 0.0) == (pytest.approx(0.020), 0.0)
    assert pm.step_time(0.020, plan, 1, SLOW, 0.0) == (0.020, 0.0)        # N=1: no averaging


def test_overlap_one_bucket_exposed():
    # the first layer's bucket is ready only when backward ends: its whole 2 ms is exposed
    plan = pm.OverlapPlan([(4e6, 1, 1.0)], backward_share=0.5)
    s = pm.overlap_schedule(0.010, plan, 2, SLOW, mu=0.0)
    assert s["start"] == [pytest.approx(0.010)] and s["exposed"] == pytest.approx(0.002)
    step, comm = pm.step_time(0.020, plan, 2, SLOW, 0.0)
    assert step == pytest.approx(0.022) and comm == pytest.approx(0.002)


def test_overlap_chain_bottlenecked_by_the_comm_thread():
    # four 4 ms buckets ready at 1, 2, 3, 4 ms of a 10 ms backward: each waits for the previous
    # one, not for backward; they end at 5, 9, 13, 17 ms, so 7 ms stick out of backward
    net = dict(SLOW, alpha=2e-3)
    plan = pm.OverlapPlan([(1e6, 1, 0.1), (1e6, 1, 0.2), (1e6, 1, 0.3), (1e6, 1, 0.4)], 1.0)
    s = pm.overlap_schedule(0.010, plan, 2, net, mu=0.0)
    assert s["start"] == pytest.approx([0.001, 0.005, 0.009, 0.013])
    assert s["end"] == pytest.approx([0.005, 0.009, 0.013, 0.017])
    assert s["exposed"] == pytest.approx(0.007)
    assert pm.step_time(0.010, plan, 2, net, 0.0)[1] == pytest.approx(0.007)
    # without overlap the same buckets cost all 16 ms after backward
    assert pm.step_time(0.010, [(1e6, 1)] * 4, 2, net, 0.0)[1] == pytest.approx(0.016)


def test_overlap_copies_pack_scale_unpack():
    # a packed bucket (2 tensors, 1 MB, mu = 1 ns/byte: 1 ms per pass): packed on the main
    # thread when ready (5 + 1 ms), allreduce 2 ms + 1/N pass 1 ms on the comm thread (ends
    # 9 ms), backward ends at 11 ms (10 + the pack), unpack 1 ms after: comm adds 2 ms
    plan = pm.OverlapPlan([(1e6, 2, 0.5)], backward_share=1.0)
    s = pm.overlap_schedule(0.010, plan, 2, SLOW, mu=1e-9)
    assert s["ready"] == [pytest.approx(0.006)] and s["end"] == [pytest.approx(0.009)]
    assert s["backward_end"] == pytest.approx(0.011) and s["exposed"] == 0.0
    assert pm.step_time(0.010, plan, 2, SLOW, 1e-9)[1] == pytest.approx(0.002)


def test_overlap_without_a_spare_core_shares_it():
    # one core per rank: while both threads run each gets half of it (hand-computed)
    starts, ends, bwd_end = pm.comm_thread_shared([1.0, 4.0], [1.0, 1.0], 4.0, 1.0)
    assert (starts, ends, bwd_end) == ([1.0, 5.0], [3.0, 6.0], 5.0)
    # a bucket ready at once: 2 + 4 s of work on one core end at 6 s, nothing is hidden
    assert pm.comm_thread_shared([0.0], [2.0], 4.0, 1.0) == ([0.0], [4.0], 6.0)
    # two cores per rank: the free-core simulation
    assert pm.comm_thread_shared([1.0, 4.0], [1.0, 1.0], 4.0, 2.0)[:2] == \
        pm.comm_thread([1.0, 4.0], [1.0, 1.0])
    # 2 ranks on 2 cores: backward 10 ms, a 2 ms bucket ready at once -> serial, +2 ms
    plan = pm.OverlapPlan([(4e6, 1, 0.0)], backward_share=0.5)
    assert pm.step_time(0.020, plan, 2, SLOW, 0.0, ranks_per_node=2, cores=2)[1] == \
        pytest.approx(0.002)
    assert pm.step_time(0.020, plan, 2, SLOW, 0.0, ranks_per_node=2, cores=4)[1] == 0.0


def test_overlap_buckets_reverse_order_and_ready_fractions():
    # layers (forward order): 100 FLOPs with grads 40 + 4 bytes, a pooling layer, 300 FLOPs
    # with 400 + 8; reversed: 8, 400 (ready at 300/400), then 4, 40 (ready at the end)
    layers = [(100, [40, 4]), (0, []), (300, [400, 8])]
    assert pm.overlap_buckets(layers, 50) == [(8, 1, 0.75), (400, 1, 0.75), (44, 2, 1.0)]
    assert pm.overlap_buckets(layers, 10_000) == [(452, 4, 1.0)]


def test_overlap_plan_matches_comm_overlap():
    overlap = pytest.importorskip("mpitrain.comm.overlap")
    models = pytest.importorskip("mpitrain.nn.models")
    for name in ("mlp", "lenet"):
        params = models.get(name).parameters()
        specs = [(p.data.shape, p.data.dtype) for p in reversed(params)]
        for threshold in (0, 1 << 16, 4 << 20, 64 << 20):
            want = [b.total * 4 for b in
                    overlap.BucketAllreduce(specs, threshold, None, {})._plan()]
            got = pm.overlap_buckets(pm.backward_layers(name, 64), threshold)
            assert [nb for nb, _, _ in got] == want, (name, threshold)
            assert got[-1][2] == 1.0                  # the first layer's bucket: end of backward
    # lenet: fc2 + fc1 bias, fc1 weight, both convs; fc1 is ~24% of the backward GEMM FLOPs
    got = pm.overlap_buckets(pm.backward_layers("lenet", 64), 4 << 20)
    assert [c for _, c, _ in got] == [3, 1, 4]
    assert 0.2 < got[0][2] == got[1][2] < 0.3


def test_sweep_settings_follow_the_recorded_flags():
    assert pm.sweep_settings({"points": []}) is None
    assert pm.sweep_settings({"extra": ["--threads", "1"]}) == \
        {"overlap": True, "fusion_threshold_bytes": None}
    assert pm.sweep_settings({"extra": ["--no-overlap"]})["overlap"] is False
    assert pm.sweep_settings({"extra": ["--average", "weights"]})["overlap"] is False
    assert pm.sweep_settings({"extra": ["--fusion-threshold-bytes=1024"]}) == \
        {"overlap": True, "fusion_threshold_bytes": 1024}
    assert pm.sweep_settings({"extra": ["--fusion-threshold-bytes", "0", "--no-overlap"]}) == \
        {"overlap": False, "fusion_threshold_bytes": 0}
    with pytest.raises(pm.ModelError, match="'big'"):
        pm.sweep_settings({"extra": ["--fusion-threshold-bytes", "big"]})


def test_backward_share_from_the_step_benchmark(tmp_path):
    step = {"results": [{"model": "mlp", "batch": 64, "threads": 1,
                         "best": {"step_ms": 10.0, "bwd_ms": 5.0},
                         "median": {"step_ms": 12.0, "bwd_ms": 7.2}},
                        {"model": "lenet", "batch": 64, "step_time_ms": 60.0}]}
    (tmp_path / "s.json").write_text(json.dumps(step))
    med = pm.load_backward_share(tmp_path / "s.json")
    assert med == {"mlp": [(64, 1, pytest.approx(0.6))]}
    assert pm.load_backward_share(tmp_path / "s.json", "best")["mlp"][0][2] == 0.5
    assert pm.backward_share(med["mlp"], 32) == pytest.approx(0.6)
    assert pm.backward_share(None, 64) == pm.DEFAULT_BACKWARD_SHARE


def test_script_validates_as_the_sweep_ran(tmp_path):
    pytest.importorskip("mpitrain.nn.models")
    a, s = _write_inputs(tmp_path)
    pts = [{"model": "mlp", "ranks": n, "per_rank_batch": 64, "step_time_ms": ms,
            "comm_time_ms": 0.0} for n, ms in ((1, 21.0), (2, 30.0))]
    outs = {}
    for name, extra, flags in (("ov", ["--threads", "1"], []),
                               ("no", ["--no-overlap"], []),
                               ("no2", ["--no-overlap"], ["--no-overlap"])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"extra": extra, "points": pts}))
        out = tmp_path / name
        proc = subprocess.run([sys.executable, str(SCRIPT), "--allreduce", str(a), "--step",
                               str(s), "--scaling", str(tmp_path / f"{name}.json"), "--model",
                               "mlp", "--max-ranks", "8", "--no-measure", "--cores", "4",
                               "--out", str(out)] + flags,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr
        outs[name] = json.loads((out / "perfmodel.json").read_text())
    assert outs["ov"]["validation_plans"]["mlp"]["overlap"] is True
    assert outs["no"]["validation_plans"]["mlp"]["overlap"] is False       # as the sweep ran
    assert outs["no"]["fusion_plans"]["mlp"]["overlap"] is True            # projection: default
    want = pm.fusion_plan(pm.gradient_tensor_bytes("mlp"), 64 << 20)       # --no-overlap
    assert outs["no2"]["fusion_plans"]["mlp"] == {
        "overlap": False, "buckets": [{"bytes": nb, "tensors": c} for nb, c in want]}
    ov, no = outs["ov"]["validation"][1], outs["no"]["validation"][1]
    assert ov["predicted_ms"] < no["predicted_ms"]         # 4 cores: the comm thread has one
    assert no == outs["no2"]["validation"][1]
