"""What a run reports: the issue's targets per cell (median, paired and pooled ratios) and the
printed table."""

from __future__ import annotations

from typing import Any

from scripts.engine_bench.local import FIXED_K
from scripts.engine_bench.results import RunResult
from scripts.harness import markdown_table, percentile


def paired(a: RunResult, b: RunResult, busy: bool = False) -> float:
    """Median over repetitions of a's rate over b's in the same repetition (adjacent in time);
    `busy`: the rates over the busy window."""
    xs, ys = ((a.rep_busy_tokens_per_s, b.rep_busy_tokens_per_s) if busy
              else (a.rep_tokens_per_s, b.rep_tokens_per_s))
    return percentile([x / y for x, y in zip(xs, ys)], 50) or 0.0


def pooled(a: RunResult, b: RunResult) -> float:
    """a's rate over b's with every repetition pooled: all output tokens over all wall time.
    A third view beside the medians and the paired ratio: a repetition that ran slow for
    everyone weighs as its time did (copy b32 at cab7f20: 0.971x k4 on medians, 55.24 s of
    wall time against 55.02 over the same three waves)."""
    return (a.output_tokens / a.wall_s) / (b.output_tokens / b.wall_s)


def targets(results: list[RunResult]) -> dict[str, Any]:
    """The issue's targets per cell (workload, batch), on median tok/s, paired and pooled
    ratios."""
    by = {(r.engine, r.mode, r.workload, r.batch): r for r in results}
    cells = sorted({(r.workload, r.batch) for r in results if r.engine == "local"})
    out: dict[str, Any] = {}
    for w, b in cells:
        ad, none = by.get(("local", "adaptive", w, b)), by.get(("local", "none", w, b))
        fixed = {m: by[("local", m, w, b)] for m in FIXED_K if ("local", m, w, b) in by}
        if ad is None:
            continue
        cell: dict[str, Any] = {}
        if none is not None:
            cell["adaptive_vs_none (>= 0.97)"] = ad.tokens_per_s / none.tokens_per_s
            cell["adaptive_vs_none_paired"] = paired(ad, none)
            cell["adaptive_vs_none_pooled"] = pooled(ad, none)
            if ad.busy_tokens_per_s and none.busy_tokens_per_s:
                cell["busy: adaptive_vs_none"] = ad.busy_tokens_per_s / none.busy_tokens_per_s
                cell["busy: adaptive_vs_none_paired"] = paired(ad, none, busy=True)
        if fixed:
            best = max(fixed.values(), key=lambda r: r.tokens_per_s)
            cell["best_fixed"] = best.mode
            cell["adaptive_vs_best_fixed (>= 0.97)"] = ad.tokens_per_s / best.tokens_per_s
            cell["adaptive_vs_best_fixed_paired"] = min(paired(ad, r) for r in fixed.values())
            cell["adaptive_vs_best_fixed_pooled"] = min(pooled(ad, r) for r in fixed.values())
            cell["beats_every_fixed"] = all(ad.tokens_per_s > r.tokens_per_s
                                            for r in fixed.values())
            busy_fixed = [r.busy_tokens_per_s for r in fixed.values()]
            if ad.busy_tokens_per_s and all(busy_fixed):
                cell["busy: adaptive_vs_best_fixed"] = ad.busy_tokens_per_s / max(busy_fixed)
                cell["busy: adaptive_vs_best_fixed_paired"] = min(
                    paired(ad, r, busy=True) for r in fixed.values())
        for m in ("suffix", "suffix-fixed"):
            sx = by.get(("local", m, w, b))
            if sx is not None and none is not None:
                cell[f"{m}_vs_none"] = sx.tokens_per_s / none.tokens_per_s
                cell[f"{m}_vs_none_paired"] = paired(sx, none)
            if sx is not None:
                cell[f"{m}_vs_adaptive_ngram"] = sx.tokens_per_s / ad.tokens_per_s
        out[f"{w}/b{b}"] = cell
    copy1 = out.get("copy/b1", {}).get("adaptive_vs_none (>= 0.97)")
    out["copy_b1_adaptive_vs_none (>= 1.8)"] = copy1
    out["mix_b8_beats_every_fixed"] = out.get("mix/b8", {}).get("beats_every_fixed")
    return out


COLUMNS = ("engine", "mode", "workload", "batch", "tok/s median", "spread", "busy tok/s",
           "tok/cpu-s", "TTFT p50 ms", "ITL p50 ms", "tok/verify", "acc. rate", "step ms")


def table(results: list[RunResult]) -> str:
    def f(v: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    rows = []
    for r in results:
        engine = r.engine if r.cores is None else f"{r.engine} ({r.cores} cores)"
        rows.append([engine, r.mode, r.workload, str(r.batch), f"{r.tokens_per_s:.1f}",
                     f(r.spread, "{:.0%}"), f(r.busy_tokens_per_s), f(r.tokens_per_cpu_s or None),
                     f(r.ttft_p50_ms, "{:.0f}"), f(r.itl_p50_ms, "{:.0f}"),
                     f(r.mean_accepted_len, "{:.2f}"), f(r.acceptance_rate, "{:.2f}"),
                     f(r.breakdown_ms.get("step"), "{:.0f}")])
    return markdown_table(COLUMNS, rows)
