"""The report: the fit, the bucket plans, the efficiency table (text or markdown), the PNG."""
import numpy as np

from .network import default_ring_threshold
from .plans import OverlapPlan


TARGET_ERROR = 0.15


def _eng(seconds_per_byte):
    return "inf" if seconds_per_byte <= 0 else f"{1 / seconds_per_byte / 1e9:.2f} GB/s"


def describe_plan(plan, threshold):
    """One line per model: bucket sizes, path (ring or MPI) and, overlapped, when each is ready.
    threshold None: mpitrain's default, which is lower between two ranks."""
    def path(nb):
        if threshold is not None:
            return "ring" if nb >= threshold else "MPI"
        if nb >= default_ring_threshold(3):
            return "ring"
        return "MPI; ring at N=2" if nb >= default_ring_threshold(2) else "MPI"
    if isinstance(plan, OverlapPlan):
        return (", ".join(f"{nb / 1e6:.2f} MB ({path(nb)}, ready at {100 * r:.0f}%)"
                          for nb, _, r in plan.buckets)
                + f"; backward = {100 * plan.backward_share:.0f}% of compute")
    return ", ".join(f"{nb / 1e6:.2f} MB ({path(nb)})" for nb, _ in plan)


def _mode(plans):
    plan = next(iter(plans.values()), None)
    if isinstance(plan, OverlapPlan):
        return "allreduce overlapped with backward (buckets in reverse layer order)"
    return "allreduce after backward (fusion plan)"


def format_report(fitted, mu, nets, proj, rows, models, markdown=False, mpi=None, plans=None,
                  val_plans=None):
    lines = []
    gam = fitted["gamma"]
    lines.append(f"ring fit ({fitted['ring_points']} ring + {fitted['reduce_points']} reduce "
                 f"timings, relative RMS residual {100 * fitted['rel_rms']:.1f}%): "
                 f"alpha = {fitted['alpha'] * 1e6:.2f} us, beta = 1/{_eng(fitted['beta'])}, "
                 f"gamma = {'unknown' if gam is None else '1/' + _eng(gam)}, "
                 f"copy mu = 1/{_eng(mu)}")
    lines.append(f"identifiable: {fitted['identifiable']}")
    threshold = nets[0].get("ring_threshold", 0)
    if mpi:
        lines.append(f"MPI_Allreduce fit ({mpi['points']} timings, relative RMS residual "
                     f"{100 * mpi['rel_rms']:.1f}%): alpha_mpi = {mpi['alpha'] * 1e6:.2f} us, "
                     f"2beta+gamma = 1/{_eng(mpi['combined'])}; used for buckets < "
                     + (f"{threshold} bytes" if threshold is not None else
                        f"{default_ring_threshold(2)} bytes at N=2, < "
                        f"{default_ring_threshold(3)} bytes from N=3"))
    if plans:
        lines.append(f"projection: {_mode(plans)}")
    for model in models if plans else ():
        lines.append(f"{model} gradient buckets: {describe_plan(plans[model], threshold)}")
    pow2 = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
            if n <= len(next(iter(next(iter(proj.values())).values()))["ranks"])]
    head = ["network", "model"] + [f"N={n}" for n in pow2]
    table = []
    for net in nets:
        for model in models:
            eff = proj[net["name"]][model]["efficiency"]
            table.append([net["name"], model] + [f"{eff[n - 1]:.2f}" for n in pow2])
    lines.append("")
    lines.append("predicted weak-scaling efficiency (one rank per node):")
    lines += _table(head, table, markdown)
    if rows:
        lines.append("")
        lines.append("validation against the measured sweep (step time, all ranks on this node)"
                     + (f", as the sweep ran: {_mode(val_plans)}" if val_plans else "") + ":")
        if val_plans and plans and val_plans != plans:
            for model in sorted({r["model"] for r in rows}):
                lines.append(f"{model} buckets as run: "
                             f"{describe_plan(val_plans[model], threshold)}")
        vhead = ["model", "N", "measured ms", "predicted ms", "error", "meas. comm ms",
                 "pred. comm ms"]
        vrows = [[r["model"], f"{r['ranks']}{'*' if r['oversubscribed'] else ''}",
                  f"{r['measured_ms']:.2f}", f"{r['predicted_ms']:.2f}",
                  f"{100 * r['error']:+.1f}%",
                  "-" if r["measured_comm_ms"] is None else f"{r['measured_comm_ms']:.2f}",
                  f"{r['predicted_comm_ms']:.2f}"] for r in rows]
        lines += _table(vhead, vrows, markdown)
        worst = max(abs(r["error"]) for r in rows)
        verdict = "within" if worst <= TARGET_ERROR else "OUTSIDE"
        lines.append(f"worst step-time error {100 * worst:.1f}%: {verdict} the "
                     f"{100 * TARGET_ERROR:.0f}% target" +
                     ("  (* oversubscribed)" if any(r["oversubscribed"] for r in rows) else ""))
    return "\n".join(lines)


def _table(head, rows, markdown):
    if markdown:   # blank lines around: a table must not run into the text next to it
        return (["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                + ["| " + " | ".join(r) + " |" for r in rows] + [""])
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    return ["  ".join(str(c).rjust(w) if i > 1 else str(c).ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths))) for r in [head] + rows]


def plot(proj, rows, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncol = len(models) + (1 if rows else 0)
    fig, axes = plt.subplots(1, ncol, figsize=(4.2 * ncol, 4))
    axes = np.atleast_1d(axes)
    for ax, model in zip(axes, models):
        for i, (name, per_model) in enumerate(proj.items()):
            d = per_model[model]
            ax.plot(d["ranks"], d["efficiency"], color=f"C{i}", label=name)
        measured = {r["ranks"]: r["measured_ms"] for r in rows if r["model"] == model}
        if 1 in measured:
            ns = sorted(measured)
            ax.plot(ns, [measured[1] / measured[n] for n in ns], "ko", mfc="none",
                    label="measured (this node)")
        ax.set_xscale("log", base=2)
        ticks = [n for n in (1, 4, 16, 64, 256, 1024) if n <= d["ranks"][-1]]
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.set_ylim(0, 1.05)
        ax.set_title(model)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("efficiency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if rows:
        ax = axes[-1]
        meas = np.array([r["measured_ms"] for r in rows])
        pred = np.array([r["predicted_ms"] for r in rows])
        lim = [0, max(meas.max(), pred.max()) * 1.15]
        ax.plot(lim, lim, "k-", lw=1)
        ax.fill_between(lim, [v * (1 - TARGET_ERROR) for v in lim],
                        [v * (1 + TARGET_ERROR) for v in lim], color="0.9", label="+-15%")
        for i, model in enumerate(models):
            sel = [r for r in rows if r["model"] == model]
            for r in sel:
                ax.plot(r["measured_ms"], r["predicted_ms"], "o", color=f"C{i}",
                        mfc="none" if r["oversubscribed"] else f"C{i}")
                ax.annotate(f"{r['ranks']}", (r["measured_ms"], r["predicted_ms"]),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
            if sel:
                ax.plot([], [], "o", color=f"C{i}", label=model)
        ax.set_xlim(lim)
        ax.set_ylim(lim)
        ax.set_xlabel("measured step ms")
        ax.set_ylabel("predicted step ms")
        ax.set_title("validation (label: N)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
