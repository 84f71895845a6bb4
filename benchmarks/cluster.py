"""Allreduce across two hosts at each link rate: ours, MPI_Allreduce and torch's gloo, flat and
hierarchical, on namespace hosts of this machine (tests/support/netns_hosts.py; needs root).

    python benchmarks/cluster.py [--rates none,10gbit,1gbit] [--max-bytes 64M] \\
                                 [--out out/bench/cluster] [--markdown]

For each rate (tc's spelling; ``none``: the unshaped veth), on the same two hosts:
  2 hosts x 1 rank   benchmarks/allreduce.py --algo ring   ours vs MPI_Allreduce, 4 KB .. max
                     benchmarks/gloo_allreduce.py          gloo over the same link (with torch)
  2 hosts x 2 ranks  benchmarks/hierarchical.py --algo ring   flat vs hierarchical
busbw = bytes / time * 2(N-1)/N in GB/s (what each rank must move; the link's line rate is its
ceiling at one rank per host). Every result is written under --out as JSON, and with
--markdown one table per rate is printed for docs/benchmarks.md.

The performance model (perfmodel_lib) is then checked on the real link: alpha and beta of the
link fitted on the 2 x 1 ring timings (64 KB and up), those of the node on a 1 x 2 run inside
host1, and the 2 x 2 flat and hierarchical times predicted from them (perfmodel_lib.hierarchical)
beside the measured ones.
"""
import argparse
import json
import os
import importlib.util
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]    # benchutil; tests.support on the source tree
import benchutil  # noqa: E402
from perfmodel_lib import fitting  # noqa: E402
from perfmodel_lib import hierarchical as model  # noqa: E402
from tests.support import netns_hosts  # noqa: E402

SIZES = "4K,64K,1M,16M,64M"


def run(cluster, hosts, n, argv, timeout_s=1800):
    p = cluster.launch(hosts, n, [sys.executable, *argv], timeout_s=timeout_s, cwd=HERE.parent,
                       env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"})
    if p.returncode != 0:
        raise SystemExit(f"cluster.py: {' '.join(argv)} failed ({p.returncode}):\n"
                         f"{p.stderr[-2000:]}")
    return p.stdout


def measure(cluster, rate, out, max_bytes, gloo):
    cluster.shape(rate=None if rate == "none" else rate)
    tag = rate.replace("/", "_")
    ours = out / f"allreduce-{tag}.json"
    run(cluster, "host1:1,host2:1", 2, [str(HERE / "allreduce.py"), "--algo", "ring",
                                        "--min-bytes", "4K", "--max-bytes", max_bytes,
                                        "--json", str(ours)])
    hier = out / f"hierarchical-{tag}.json"
    sizes = ",".join(s for s in SIZES.split(",")
                     if benchutil.parse_bytes(s) <= benchutil.parse_bytes(max_bytes))
    run(cluster, "host1:2,host2:2", 4, [str(HERE / "hierarchical.py"), "--algo", "ring",
                                        "--sizes", sizes, "--rounds", "2", "--iters", "3",
                                        "--json", str(hier)])
    result = {"rate": rate, "allreduce": json.loads(ours.read_text()),
              "hierarchical": json.loads(hier.read_text()), "gloo": None}
    if gloo:
        text = run(cluster, "host1:1,host2:1", 2,
                   [str(HERE / "gloo_allreduce.py"), cluster.address("host1"), "--sizes", sizes])
        result["gloo"] = json.loads(re.findall(r"\{.*\}", text)[-1])
    cluster.shape()
    return result


def link_fit(doc, ranks, min_bytes=64 << 10):
    """{"alpha", "beta"} of the ring timings of an allreduce.py JSON (gamma folded into beta)."""
    obs = [(r["bytes"], ranks, r["ours_s"]) for r in doc["results"] if r["bytes"] >= min_bytes]
    fitted = fitting.fit(obs)
    return {"alpha": fitted["alpha"], "beta": fitted["combined"] / 2,
            "rel_rms": fitted["rel_rms"]}


def model_check(result, intra):
    """Predicted vs measured 2 x 2 flat and hierarchical times of one rate."""
    inter = link_fit(result["allreduce"], 2)
    rows = []
    for r in result["hierarchical"]["results"]:
        flat = float(model.flat_time(r["bytes"], 2, 2, intra, inter))
        hier = float(model.hierarchical_time(r["bytes"], 2, 2, intra, inter))
        rows.append({"bytes": r["bytes"], "flat_s": r["flat_s"], "flat_model_s": flat,
                     "hierarchical_s": r["hierarchical_s"], "hierarchical_model_s": hier})
    return {"inter": inter, "intra": intra, "rows": rows}


def model_table(check):
    inter = check["inter"]
    lines = [f"Model: link alpha {inter['alpha'] * 1e6:.1f} us, "
             f"{1 / inter['beta'] / 1e9:.3f} GB/s (fit rel. rms {inter['rel_rms']:.2f}); node "
             f"alpha {check['intra']['alpha'] * 1e6:.1f} us, "
             f"{1 / check['intra']['beta'] / 1e9:.2f} GB/s", "",
             "| size | 2x2 flat ms | model | error | 2x2 hier ms | model | error |",
             "|---|---|---|---|---|---|---|"]
    for r in check["rows"]:
        b = r["bytes"]
        size = f"{b // 1024} KB" if b < 1 << 20 else f"{b >> 20} MB"
        cells = []
        for key in ("flat", "hierarchical"):
            got, want = r[f"{key}_s"], r[f"{key}_model_s"]
            cells.append(f"{got * 1e3:.2f} | {want * 1e3:.2f} | {got / want - 1:+.0%}")
        lines.append(f"| {size} | {' | '.join(cells)} |")
    return "\n".join(lines)


def table(result):
    """One markdown table of a rate: busbw (GB/s) by size."""
    gloo = {r["bytes"]: r for r in (result["gloo"] or {}).get("results", [])}
    hier = {r["bytes"]: r for r in result["hierarchical"]["results"]}
    lines = [f"Link: {result['rate']}", "",
             "| size | 2x1 ours | 2x1 MPI_Allreduce | 2x1 gloo | 2x2 flat ms | 2x2 hier ms "
             "| flat/hier |", "|---|---|---|---|---|---|---|"]
    for r in result["allreduce"]["results"]:
        b = r["bytes"]
        if b not in hier:
            continue
        g = f"{gloo[b]['busbw_GBps']:.3f}" if b in gloo else ""
        h = hier[b]
        hcols = (f"{h['flat_s'] * 1e3:.2f} | {h['hierarchical_s'] * 1e3:.2f} | "
                 f"{h['speedup']:.2f}")
        lines.append(f"| {b // 1024 if b < 1 << 20 else b >> 20} {'KB' if b < 1 << 20 else 'MB'} "
                     f"| {r['ours_busbw_GBps']:.3f} | {r['mpi_busbw_GBps']:.3f} | {g} | {hcols} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="none,10gbit,1gbit")
    p.add_argument("--max-bytes", default="64M")
    p.add_argument("--out", default="out/bench/cluster")
    p.add_argument("--no-gloo", action="store_true", help="skip torch's gloo")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    why = netns_hosts.unavailable()
    if why:
        print(f"cluster.py: error: {why}", file=sys.stderr)
        return 2
    gloo = not args.no_gloo
    if gloo and importlib.util.find_spec("torch") is None:
        print("cluster.py: error: gloo needs torch (pip install 'mpitrain[torch]'), or "
              "give --no-gloo", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with netns_hosts.Cluster(2) as cluster:
        node = out / "allreduce-node.json"
        run(cluster, "host1:2", 2, [str(HERE / "allreduce.py"), "--algo", "ring",
                                    "--min-bytes", "4K", "--max-bytes", args.max_bytes,
                                    "--json", str(node)])
        intra = link_fit(json.loads(node.read_text()), 2)
        for rate in args.rates.split(","):
            print(f"# link {rate}", flush=True)
            results.append(measure(cluster, rate, out, args.max_bytes, gloo))
            results[-1]["model"] = model_check(results[-1], intra)
            if args.markdown:
                print(table(results[-1]) + "\n\n" + model_table(results[-1]["model"]) + "\n",
                      flush=True)
    load = os.getloadavg()
    benchutil.write_json(out / "cluster.json", {"load_average_at_end": load,
                                                "results": results})
    print(f"# wrote {out / 'cluster.json'} (load average {load[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
