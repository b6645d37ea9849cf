"""The reference every greedy engine output must equal, and how the outputs compare with it."""

from __future__ import annotations

from typing import Any

from scripts.engine_bench.results import RunResult
from scripts.harness import first_difference


def prompt_key(rid: str) -> str:
    """The workload prompt a request ran (rids are `<prompt id>#<i>.<rep>`)."""
    return rid.split("#", 1)[0]


def reference_outputs(runner: Any, prompts: dict[str, list[int]], max_tokens: int,
                      eos: list[int]) -> dict[str, list[int]]:
    """Target-only greedy output of each prompt, one request at a time, one token per forward,
    stopping after an EOS id like the engine: the yardstick every greedy mode must equal. Kept
    apart from the engine loop on purpose (and from tests/support/reference_decode.py, which is
    test-only): two independent decoders that agree are the evidence."""
    out = {}
    for key, ids in prompts.items():
        slot = runner.allocate()
        try:
            logits = runner.forward([slot], [list(ids)], last_only=True)[0]
            toks = [int(logits[-1].argmax())]
            while len(toks) < max_tokens and toks[-1] not in eos:
                logits = runner.forward([slot], [[toks[-1]]])[0]
                toks.append(int(logits[-1].argmax()))
        finally:
            runner.free(slot)
        out[key] = toks
    return out


def reference_mismatches(results: list[RunResult],
                         reference: dict[str, dict[str, list[int]]]) -> list[str]:
    """Every greedy engine output that differs from the reference, described."""
    out = []
    for r in results:
        if r.engine == "hf":
            continue
        ref = reference.get(r.workload, {})
        for rid, got in r.outputs.items():
            want = ref.get(prompt_key(rid))
            if want is None or got == want:
                continue
            pos = first_difference(want, got)
            out.append(f"{r.workload} batch {r.batch} {r.engine}/{r.mode} {rid}: differs at "
                       f"token {pos}: {want[pos:pos + 5]} vs {got[pos:pos + 5]} "
                       f"(lengths {len(want)} vs {len(got)})")
    return out


def hf_agreement(results: list[RunResult],
                 reference: dict[str, dict[str, list[int]]]) -> dict[str, float]:
    """Share of HF requests whose greedy output equals the reference (numerics, not a gate)."""
    out = {}
    for r in results:
        if r.engine == "hf" and r.outputs:
            ref = reference.get(r.workload, {})
            same = sum(ref.get(prompt_key(rid)) == toks for rid, toks in r.outputs.items())
            out[f"{r.mode}/{r.workload}"] = same / len(r.outputs)
    return out
