"""`specrelay trace FILE... [--request RID | --step N] [--format table|json]`

Reads OTLP JSON-lines trace files: a request's timeline (k chosen, drafts verified, accepted and
kept, its finish), the requests a step finished, or a summary. Traces without the per-request
arrays (pipeline/tracing/schema.py) find steps through span links, with the counts unknown.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.tracing.schema import (
    ENGINE_STEP_SPAN,
    FINISH_EVENT,
    REQUEST_SPAN,
    STEP_SPAN,
    matched_from_attributes,
    retained_from_step,
)
from pipeline.tracing.trace_file import SpanRecord, read_spans


@dataclass
class StepEntry:
    step: int
    drafted: int | None
    accepted: int | None  # raw, before finish truncation
    retained: int | None


@dataclass
class ControlEntry:
    step: int
    k: int | None
    cap: int | None
    why: str | None
    plan: str | None


@dataclass
class Finish:
    step: int | None
    reason: str
    matched: int | str | None
    len: int | None
    window_position: int | None


@dataclass
class RequestReport:
    request: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    verify_ct: int | None = None
    accepted_tokens: int | None = None
    steps: list[StepEntry] = field(default_factory=list)
    finish: Finish | None = None
    control: list[ControlEntry] = field(default_factory=list)  # empty: no engine spans


@dataclass
class StepReport:
    step: int
    batch_size: int | None
    drafted_tokens: int | None
    accepted_tokens: int | None
    requests: list[str]
    finished: list[dict[str, Any]]


class TraceIndex:
    def __init__(self, spans: list[SpanRecord]) -> None:
        self.requests: dict[str, SpanRecord] = {}
        self.steps: list[SpanRecord] = []
        self.engine_steps: list[SpanRecord] = []
        for s in spans:
            if s.name == REQUEST_SPAN and "request.id" in s.attributes:
                self.requests[str(s.attributes["request.id"])] = s
            elif s.name == STEP_SPAN and "spec.step" in s.attributes:
                self.steps.append(s)
            elif s.name == ENGINE_STEP_SPAN and "spec.step" in s.attributes:
                self.engine_steps.append(s)
        for found in (self.steps, self.engine_steps):
            found.sort(key=lambda s: (int(s.attributes["spec.step"]), s.start_ns))
        self._rid_of_span = {s.span_id: rid for rid, s in self.requests.items()}

    def step_entries(self, step: SpanRecord) -> dict[str, StepEntry]:
        a = step.attributes
        n = int(a["spec.step"])
        ids = a.get("spec.request.ids")
        if ids is None:
            rids = [self._rid_of_span.get(ln.span_id) for ln in step.links]
            return {rid: StepEntry(n, None, None, None) for rid in rids if rid is not None}
        drafted = a.get("spec.request.drafted") or [None] * len(ids)
        accepted = a.get("spec.request.accepted") or [None] * len(ids)
        retained = retained_from_step(a, step.events)
        return {
            str(rid): StepEntry(n, d, acc, r)
            for rid, d, acc, r in zip(ids, drafted, accepted, retained)
            if r is None or r > 0  # 0: the step was dropped for this request
        }

    def control_entries(self, step: SpanRecord) -> dict[str, ControlEntry]:
        a = step.attributes
        ids = a.get("spec.request.ids") or ()
        n = int(a["spec.step"])
        ks, caps, why = (a.get(f"spec.control.{x}") or [None] * len(ids) for x in ("k", "cap", "why"))
        plan = a.get("spec.control.plan")
        return {str(rid): ControlEntry(n, k, c, w, plan)
                for rid, k, c, w in zip(ids, ks, caps, why)}

    def finishes(self, step: SpanRecord) -> list[dict[str, Any]]:
        out = []
        for ev in step.events:
            if ev.name != FINISH_EVENT:
                continue
            a = ev.attributes
            out.append(
                {
                    "request": a.get("request.id"),
                    "reason": a.get("finish.reason"),
                    "matched": matched_from_attributes(a),
                    "len": a.get("finish.len"),
                    "window_position": a.get("finish.window_position"),
                }
            )
        return out

    def request(self, rid: str) -> RequestReport | None:
        span = self.requests.get(rid)
        rep = RequestReport(request=rid)
        if span is not None:
            a = span.attributes
            rep.prompt_tokens = a.get("request.prompt_tokens")
            rep.completion_tokens = a.get("request.completion_tokens")
            rep.verify_ct = a.get("spec.verify_ct")
            rep.accepted_tokens = a.get("spec.accepted_tokens")
            if a.get("finish.reason"):
                rep.finish = Finish(
                    a.get("finish.step"), a["finish.reason"], matched_from_attributes(a), None, None
                )
        for step in self.steps:
            entry = self.step_entries(step).get(rid)
            if entry is not None:
                rep.steps.append(entry)
            for f in self.finishes(step):
                if f["request"] == rid:
                    rep.finish = Finish(
                        int(step.attributes["spec.step"]),
                        f["reason"],
                        f["matched"],
                        f["len"],
                        f["window_position"],
                    )
        for step in self.engine_steps:
            control = self.control_entries(step).get(rid)
            if control is not None:
                rep.control.append(control)
        if span is None and not rep.steps and rep.finish is None:
            return None
        return rep

    def step(self, n: int) -> list[StepReport]:
        out = []
        for s in self.steps:
            a = s.attributes
            if int(a["spec.step"]) != n:
                continue
            out.append(
                StepReport(
                    step=n,
                    batch_size=a.get("spec.batch_size"),
                    drafted_tokens=a.get("spec.drafted_tokens"),
                    accepted_tokens=a.get("spec.accepted_tokens"),
                    requests=list(self.step_entries(s)),
                    finished=self.finishes(s),
                )
            )
        return out

    def summary(self) -> dict[str, Any]:
        reasons: Counter[str] = Counter()
        for s in self.requests.values():
            reason = s.attributes.get("finish.reason")
            reasons[str(reason) if reason else "unfinished"] += 1
        hist: Counter[int] = Counter()
        drafted = accepted = 0
        reached: Counter[int] = Counter()  # by draft position
        kept: Counter[int] = Counter()
        seen: set[str] = set()  # a request's first step is its prefill
        undrafted_steps = undrafted_entries = 0
        by_step: dict[int, Counter[str]] = {}
        for s in self.steps:
            decodes = 0
            drafted_here = 0
            for rid, e in self.step_entries(s).items():
                if rid in seen:
                    decodes += 1
                    drafted_here += int(e.drafted or 0)
                    undrafted_entries += e.drafted == 0
                seen.add(rid)
                if e.drafted and e.accepted is not None:  # verify steps only, not prefills
                    hist[int(e.accepted)] += 1
                    drafted += int(e.drafted)
                    accepted += int(e.accepted)
                    for pos in range(int(e.drafted)):
                        reached[pos] += 1
                        kept[pos] += pos < int(e.accepted)
            undrafted_steps += decodes > 0 and drafted_here == 0
            for f in self.finishes(s):
                by_step.setdefault(int(s.attributes["spec.step"]), Counter())[f["reason"]] += 1
        return {
            "requests": len(self.requests),
            "steps": len({int(s.attributes["spec.step"]) for s in self.steps}),
            "finish_reasons": dict(sorted(reasons.items())),
            "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_by_position": [
                {"position": p, "drafted": reached[p], "accepted": kept[p],
                 "rate": kept[p] / reached[p]} for p in sorted(reached)],
            "steps_without_drafts": undrafted_steps,
            "request_steps_without_drafts": undrafted_entries,
            "finishes_by_step": {str(n): dict(sorted(c.items())) for n, c in sorted(by_step.items())},
        }


# ---------------------------------------------------------------------------------------- output


def _matched_text(m: int | str | None) -> str:
    if m is None:
        return "-"
    return f"token {m}" if isinstance(m, int) else json.dumps(m, ensure_ascii=False)


def _cell(v: Any) -> str:
    return "-" if v is None else str(v)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def format_request(rep: RequestReport) -> str:
    lines = [
        (
            f"request {rep.request}: prompt_tokens={_cell(rep.prompt_tokens)} "
            f"completion_tokens={_cell(rep.completion_tokens)} verify_ct={_cell(rep.verify_ct)} "
            f"accepted_tokens={_cell(rep.accepted_tokens)}"
        ),
        _timeline(rep),
    ]
    f = rep.finish
    if f is None:
        lines.append("not finished")
    else:
        lines.append(
            f"finished: step={_cell(f.step)} reason={f.reason} matched={_matched_text(f.matched)} "
            f"window_position={_cell(f.window_position)} len={_cell(f.len)}"
        )
    return "\n".join(lines)


def _timeline(rep: RequestReport) -> str:
    control = {c.step: c for c in rep.control}
    finish_step = rep.finish.step if rep.finish is not None else None
    rows = []
    for e in rep.steps:
        c = control.get(e.step)
        ended = rep.finish.reason if rep.finish is not None and e.step == finish_step else None
        rows.append([e.step, c and c.k, c and c.cap, c and c.why,
                     e.drafted, e.accepted, e.retained, ended])
    header = ["step", "k", "cap", "why", "drafted", "accepted", "retained", "finish"]
    return _table(header, rows)


def format_step(rep: StepReport) -> str:
    head = (
        f"step {rep.step}: batch_size={_cell(rep.batch_size)} "
        f"drafted_tokens={_cell(rep.drafted_tokens)} accepted_tokens={_cell(rep.accepted_tokens)}"
    )
    if not rep.finished:
        return head + "\nfinished no request"
    rows = [
        [f["request"], f["reason"], _matched_text(f["matched"]), f["window_position"], f["len"]]
        for f in rep.finished
    ]
    return head + "\n" + _table(["request", "reason", "matched", "window_position", "len"], rows)


def format_summary(s: dict[str, Any]) -> str:
    rate = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.3f}"
    lines = [
        f"requests: {s['requests']}",
        f"steps: {s['steps']}",
        "finish reasons: " + (", ".join(f"{k}={v}" for k, v in s["finish_reasons"].items()) or "-"),
        f"drafted: {s['drafted_tokens']}  accepted: {s['accepted_tokens']}  rate: {rate}",
        (f"steps with decodes but no draft: {s['steps_without_drafts']} "
         f"(request-steps: {s['request_steps_without_drafts']})"),
        "accepted drafts per request-step (verify steps):",
        _table(["accepted", "count"], [[k, v] for k, v in s["acceptance_histogram"].items()]),
        "acceptance by draft position (accepted / request-steps that drafted that position):",
        _table(["position", "drafted", "accepted", "rate"],
               [[p["position"], p["drafted"], p["accepted"], f"{p['rate']:.3f}"]
                for p in s["acceptance_by_position"]]),
        "finishes by step:",
        _table(["step", "reasons"], [[n, ", ".join(f"{k}={v}" for k, v in c.items())]
                                     for n, c in s["finishes_by_step"].items()]),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specrelay trace", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="FILE", help="OTLP JSON-lines trace file(s)")
    pick = parser.add_mutually_exclusive_group()
    pick.add_argument("--request", metavar="RID",
                      help="one request's timeline: k chosen vs drafts verified vs kept, finish")
    pick.add_argument("--step", type=int, metavar="N", help="show the requests step N finished")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    try:
        index = TraceIndex(read_spans(args.files))
    except (OSError, ValueError) as e:
        print(f"specrelay trace: {e}", file=sys.stderr)
        return 2
    as_json = args.format == "json"
    if args.request is not None:
        rep = index.request(args.request)
        if rep is None:
            print(f"specrelay trace: no request {args.request!r} in the traces", file=sys.stderr)
            return 1
        print(json.dumps(asdict(rep), ensure_ascii=False) if as_json else format_request(rep))
    elif args.step is not None:
        reps = index.step(args.step)
        if not reps:
            print(f"specrelay trace: no step {args.step} in the traces", file=sys.stderr)
            return 1
        if as_json:
            print(json.dumps([asdict(r) for r in reps], ensure_ascii=False))
        else:
            print("\n\n".join(format_step(r) for r in reps))
    else:
        s = index.summary()
        print(json.dumps(s, ensure_ascii=False) if as_json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
