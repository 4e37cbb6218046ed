"""PNG plots of the results (matplotlib; skipped with a message when it is not installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None (with a message) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plots skipped (pip install matplotlib)")
        return None
    return plt


def make_plots(results: dict[str, Any], out: Path) -> list[str]:
    plt = _pyplot()
    if plt is None:
        return []
    written: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    ov = results.get("overhead")
    if ov and "rows" in ov:
        rows = [(n, r) for n, r in ov["rows"].items() if not (r["family"] == "none" and n == r["baseline"])]
        names = [n for n, _ in rows]
        med = [100 * r["overhead"]["median"] for _, r in rows]
        def err(r: dict[str, Any], side: int) -> float:
            o = r["overhead"]
            bound = o["ci95"][side]
            return 0.0 if bound != bound else 100 * abs(o["median"] - bound)  # NaN: no interval

        lo = [err(r, 0) for _, r in rows]
        hi = [err(r, 1) for _, r in rows]
        colors = ["tab:green" if r["family"] == "ldformat" else ("tab:gray" if r["family"] == "none" else
                  ("tab:olive" if r.get("derived") else "tab:blue")) for _, r in rows]
        fig, ax = plt.subplots(figsize=(10, 5))
        ax.bar(range(len(rows)), med, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("step-time overhead, % (median, 95% CI)")
        ax.set_title("Training-step overhead vs no checkpointing (lowdiff: vs top-k without checkpointing)")
        ax.axhline(0, color="black", lw=0.5)
        save(fig, "overhead.png")

        fig, ax = plt.subplots(figsize=(10, 5))
        ax.bar(range(len(rows)), [100 * r["stall_fraction"] for _, r in rows], color=colors)
        ax.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("training-thread stall, % of step time")
        ax.set_yscale("symlog", linthresh=1)
        for bar, name in ((2, "lowdiff bar 2%"), (5, "xor/lowdiff+ bar 5%")):
            ax.axhline(bar, ls="--", lw=0.8, color="tab:red")
            ax.text(len(rows) - 0.5, bar, name, ha="right", va="bottom", fontsize=7, color="tab:red")
        ax.set_title("Training-thread stall per step")
        save(fig, "stall.png")

    by = results.get("bytes")
    if by and "kinds" in by:
        names = ["full checkpoint"] + list(by["kinds"])
        vals = [by["full_checkpoint_bytes"]] + [b["bytes_per_step_with_log"] for b in by["kinds"].values()]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(names, vals, color=["tab:gray"] + ["tab:green"] * (len(names) - 1))
        ax.set_yscale("log")
        ax.set_ylabel("bytes per step (deltas + log)")
        ax.set_title("Bytes on disk per checkpointed step")
        save(fig, "bytes_per_step.png")

    an = results.get("anchor")
    if an and "methods" in an:
        names = list(an["methods"])
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh(names, [m["mb_per_s"] for m in an["methods"].values()],
                color=["tab:green" if n.startswith("ldformat") else "tab:blue" for n in names])
        ax.set_xlabel("MB/s (fsync included)")
        ax.set_title("Anchor / full-state write throughput")
        save(fig, "anchor_throughput.png")

    rec = results.get("recovery")
    if rec and "kinds" in rec:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for mode, r in rec["kinds"].items():
            ks = sorted(r["per_k"], key=int)
            ax.plot([int(k) for k in ks], [r["per_k"][k]["materialize"]["median_s"] for k in ks], "o-",
                    label=f"materialize {mode}")
            if r["kind"].startswith("grad."):
                ax.plot([int(k) for k in ks], [r["per_k"][k]["reference_s"] for k in ks], ":",
                        label=f"anchor load + K AdamW steps ({mode})")
        load = next(iter(rec["kinds"].values()))["torch_load"]["median_s"]
        ax.axhline(load, color="black", ls="--", lw=0.8, label="torch.load full checkpoint")
        ax.set_xscale("log")
        ax.set_xlabel("K (deltas replayed after the anchor)")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
        ax.set_title("Recovery time")
        save(fig, "recovery.png")

    sc = results.get("scaling")
    if sc and "sizes" in sc:
        params = [e["params"] for e in sc["sizes"]]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        axes[0].plot(params, [e["full_checkpoint_bytes"] for e in sc["sizes"]], "k--", label="full checkpoint")
        for mode in sc["sizes"][0]["kinds"]:
            axes[0].plot(params, [e["kinds"][mode]["delta_bytes_per_step"] for e in sc["sizes"]], "o-", label=mode)
            axes[1].plot(params, [e["kinds"][mode]["materialize_s"] for e in sc["sizes"]], "o-", label=mode)
        axes[1].plot(params, [e["torch_load_s"] for e in sc["sizes"]], "k--", label="torch.load")
        for ax, label in ((axes[0], "bytes per step"), (axes[1], f"materialize (anchor + {sc['steps']} deltas), s")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("parameters")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        fig.suptitle("Scaling with model size")
        save(fig, "scaling.png")
    return written


def make_scale_plot(scale: dict[str, Any], out: Path) -> str | None:
    """``scale.png`` from ``benchmarks.scale``'s results: per mode, against the parameters, the
    stall fraction, background CPU per step, delta bytes / raw state and materialize time."""
    plt = _pyplot()
    if plt is None:
        return None
    from matplotlib.ticker import NullLocator
    panels = [("stall_fraction", "training-thread stall, % of step", 100.0),
              ("bg_cpu_per_step_s", "background CPU, core-s per step", 1.0),
              ("delta_over_state", "delta bytes per step / raw state", 1.0),
              ("materialize", "materialize anchor + K deltas, s", 1.0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4))
    for ax, (key, title, scale_by) in zip(axes, panels, strict=True):
        for mode, color in (("lowdiff", "tab:green"), ("lowdiff+", "tab:blue"), ("xor", "tab:red")):
            xs, ys = [], []
            for size in scale["sizes"]:
                m = size["modes"].get(mode, {})
                if not m.get("measured"):
                    continue
                value = m.get(key)
                if isinstance(value, dict):  # materialize: {"median_s": ...}
                    value = value.get("median_s")
                if value is not None:
                    xs.append(size["params"] / 1e6)
                    ys.append(value * scale_by)
            ax.plot(xs, ys, marker="o", color=color, label=mode)
        ax.set_xscale("log")
        ticks = [size["params"] / 1e6 for size in scale["sizes"]]
        ax.set_xticks(ticks, [f"{t:.0f}M" for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        if key != "stall_fraction":
            ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=110)
    plt.close(fig)
    return "scale.png"
