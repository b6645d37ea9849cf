"""PNG plots of a `bench_engine` report (matplotlib, Agg): throughput by mode and batch size,
the acceptance-length histogram, and the step-time breakdown."""

from __future__ import annotations

import os
from typing import Any

BREAKDOWN = ("draft_forward", "draft_other", "verify_forward", "verify_other", "output", "other")


def write_plots(report: dict[str, Any], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    runs = report["runs"]
    paths = [throughput(runs, out_dir), acceptance(runs, out_dir), breakdown(runs, out_dir)]
    return [p for p in paths if p]


def _label(r: dict[str, Any]) -> str:
    return r["mode"] if r["engine"] != "ray" else f"ray/{r['mode']}"


def throughput(runs: list[dict[str, Any]], out_dir: str) -> str:
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    labels = list(dict.fromkeys(_label(r) for r in runs))
    batches = sorted({r["batch"] for r in runs})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6),
                             squeeze=False)
    width = 0.8 / max(len(labels), 1)
    for ax, w in zip(axes[0], workloads):
        for j, lab in enumerate(labels):
            ys = []
            for b in batches:
                r = next((r for r in runs if r["workload"] == w and _label(r) == lab
                          and r["batch"] == b), None)
                ys.append(r["tokens_per_s"] if r else 0.0)
            ax.bar([i + j * width for i in range(len(batches))], ys, width, label=lab)
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(batches))],
                      [str(b) for b in batches])
        ax.set_yscale("log")
        ax.set_title(w)
        ax.set_xlabel("batch size")
    axes[0][0].set_ylabel("output tokens/s (log)")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, out_dir, "throughput.png")


def acceptance(runs: list[dict[str, Any]], out_dir: str) -> str:
    import matplotlib.pyplot as plt

    groups: dict[str, list[int]] = {}
    for r in runs:
        if r["engine"] != "local" or not r["histogram"] or not any(r["histogram"]):
            continue
        key = f"{r['mode']}/{r['workload']}"
        acc = groups.setdefault(key, [])
        for i, n in enumerate(r["histogram"]):
            if i >= len(acc):
                acc.append(0)
            acc[i] += n
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / max(len(groups), 1)
    for j, (key, hist) in enumerate(groups.items()):
        total = sum(hist) or 1
        ax.bar([i + j * width for i in range(len(hist))], [n / total for n in hist], width,
               label=key)
    ax.set_xlabel("accepted drafts per verify step")
    ax.set_ylabel("share of verify steps")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "acceptance.png")


def breakdown(runs: list[dict[str, Any]], out_dir: str) -> str:
    import matplotlib.pyplot as plt

    rows = [r for r in runs if r["engine"] == "local" and r["breakdown_ms"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2), 4.2))
    names = [f"{r['workload']} {r['mode']} b{r['batch']}" for r in rows]
    bottom = [0.0] * len(rows)
    for part in BREAKDOWN:
        vals = [r["breakdown_ms"].get(part, 0.0) for r in rows]
        ax.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per engine step")
    ax.set_title("step time breakdown (in-process engine)")
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "breakdown.png")


def _save(fig: Any, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
