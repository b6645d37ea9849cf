"""Speculation on a repeated agent loop with the real default model (issue 59, must-show 4):
SmolLM2-135M-Instruct answers a coding task turn after turn (same tools, growing history: call ->
tool result -> next call), greedy, `tool_choice: required`; tokens per target forward with no
drafting, n-gram and suffix drafting, every mode's calls checked against target-only greedy.

    .venv/bin/python scripts/bench_agent_loop.py [--drafts none ngram suffix] [--reps 2]
        [--turns 6] [--max-tokens 120] [--tool-choice required|cycle]
        [--fixed-k] [--k K] [--json out.json]

The app runs in-process over `LocalEngineClient(build_local_engine(config))`, reached by the
official `openai` client over httpx's ASGI transport. SmolLM2's own chat template has no tools, so
the script sets a Hermes / Qwen2.5-style one (ChatML turns, as SmolLM2's) on the served tokenizer
(`load_engine_tokenizer`, what `specrelay serve` loads) and serves with `tool_call_parser=hermes`.
`none` and `ngram` run configs/smollm2-cpu.yaml (k 4), `suffix` configs/smollm2-suffix.yaml
(k 32), each with the `speculation` its config ships unless `--fixed-k`. Modes are interleaved over
`--reps`; a fresh engine per run (its prefix cache and suffix index start empty).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: the repo root holds `pipeline` and `scripts`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import openai

from pipeline.config import load_config
from pipeline.engine.local import LocalEngineClient, build_local_engine
from pipeline.frontend.app import ServerSettings, create_app
from pipeline.models.runners import load_engine_tokenizer
from scripts.harness import commit_label, interleaved, markdown_table, run_meta, write_json

CONFIGS = {"none": "configs/smollm2-cpu.yaml", "ngram": "configs/smollm2-cpu.yaml",
           "suffix": "configs/smollm2-suffix.yaml"}

# Qwen2.5's tool template, shortened (tests/support/tool_models.py), with SmolLM2's ChatML turns:
# tools in the system turn, calls as <tool_call> JSON, results as <tool_response> in a user turn.
# A call renders as Qwen2.5's does (`<|im_start|>assistant\n<tool_call>\n{"name": "grep", ...`).
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful AI assistant.' }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or \
(message.role == 'assistant' and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}
{{ '\n' }}<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "parameters": {
            "type": "object", "additionalProperties": False, "required": list(properties),
            "properties": properties}}}


PATH = {"type": "string", "minLength": 3, "maxLength": 40, "description": "a path in the repository"}
TOOLS = [
    _tool("grep", "Search files under a path for a regular expression; returns matching lines.",
          {"pattern": {"type": "string", "minLength": 2, "maxLength": 32}, "path": PATH}),
    _tool("read_file", "Read lines of a file, numbered.",
          {"path": PATH, "start_line": {"type": "integer", "minimum": 1, "maximum": 999}}),
    _tool("run_tests", "Run pytest on a test file or node id; returns the summary.",
          {"target": {"type": "string", "minLength": 3, "maxLength": 60}}),
]
SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to find and fix "
          "the bug; call one tool at a time.")
TASK = ("tests/test_parser.py::test_nested_lists fails with IndexError: list index out of range. "
        "Find the bug in src/parser.py.")


def tool_result(name: str, args: dict[str, Any], turn: int) -> str:
    """A fake repository's answer: depends on the call and the turn, so the history grows with new
    text each turn."""
    if name == "grep":
        pattern, path = args.get("pattern", ""), args.get("path", ".")
        return "\n".join(f"{path.rstrip('/')}/parser.py:{40 + 9 * turn + i}:    "
                         f"{'if' if i else 'for'} {pattern} in items[{i}:]: depth += {turn + i}"
                         for i in range(2))
    if name == "read_file":
        start = int(args.get("start_line", 1)) + 3 * turn
        body = ["def parse_list(tokens, pos):", "    items = []",
                f"    while tokens[pos] != ']':  # turn {turn}",
                "        item, pos = parse_value(tokens, pos + 1)", "        items.append(item)",
                "    return items, pos + 1"]
        return "\n".join(f"{start + i:4d} {line}" for i, line in enumerate(body))
    return (f"FAILED tests/test_parser.py::test_nested_lists - IndexError: list index out of "
            f"range\n{1 if turn < 4 else 0} failed, {20 + turn} passed in 0.{turn + 3}1s")


def choice_for(mode: str, turn: int) -> Any:
    """`required`, or with `cycle` the tools named in turn (grep, read_file, run_tests, ...), as
    an agent framework following a plan would."""
    if mode == "required":
        return "required"
    return {"type": "function", "function": {"name": TOOLS[turn % len(TOOLS)]["function"]["name"]}}


async def agent_loop(config: Any, turns: int, max_tokens: int, mode: str, template: str
                     ) -> dict[str, Any]:
    """One fresh engine, `turns` turns; per turn: finish reason, calls, tokens, forwards, wall."""
    t0 = time.perf_counter()
    core = build_local_engine(config)
    tokenizer = load_engine_tokenizer(config)
    tokenizer.chat_template = template
    app = create_app(LocalEngineClient(core), tokenizer,
                     ServerSettings(tool_call_parser="hermes", api_key=""))
    load_s = time.perf_counter() - t0
    out: list[dict[str, Any]] = []
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": TASK}]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://bench", timeout=600) as http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://bench/v1", http_client=http)
            for t in range(turns):
                start = time.perf_counter()
                r = await client.chat.completions.create(
                    model=config.served_name, messages=msgs, tools=TOOLS,
                    tool_choice=choice_for(mode, t), parallel_tool_calls=False, temperature=0,
                    max_tokens=max_tokens)
                wall = time.perf_counter() - start
                choice = r.choices[0]
                calls = choice.message.tool_calls or []
                stats = choice.model_extra["spec_stats"]
                out.append({"finish": choice.finish_reason, "content": choice.message.content,
                            "calls": [[k.function.name, k.function.arguments] for k in calls],
                            "prompt_tokens": r.usage.prompt_tokens,
                            "tokens": r.usage.completion_tokens,
                            "forwards": stats["verify_ct"] + 1, "drafted": stats["draft_tokens"],
                            "accepted": stats["accepted_tokens"], "wall_s": wall})
                if not calls:
                    break  # nothing to answer: the loop cannot go on
                msgs.append({"role": "assistant", "content": None,
                             "tool_calls": [k.model_dump() for k in calls]})
                msgs += [{"role": "tool", "tool_call_id": k.id,
                          "content": tool_result(k.function.name,
                                                 json.loads(k.function.arguments), t)}
                         for k in calls]
    finally:
        await core.stop()
    return {"load_s": load_s, "turns": out}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Over turns 2.. of each run (turn 1 has no earlier call to learn from)."""
    per_fwd, walls, tok_s = [], [], []
    for run in runs:
        later = run["turns"][1:]
        tokens, forwards = sum(t["tokens"] for t in later), sum(t["forwards"] for t in later)
        per_fwd.append(tokens / forwards if forwards else float("nan"))
        walls.append(statistics.median(t["wall_s"] for t in later) if later else float("nan"))
        tok_s.append(tokens / sum(t["wall_s"] for t in later) if later else float("nan"))
    return {"tokens_per_forward": per_fwd, "wall_s_per_turn": walls, "tokens_per_s": tok_s}


def signature(run: dict[str, Any]) -> list[Any]:
    return [(t["finish"], t["content"], t["calls"]) for t in run["turns"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", nargs="+", default=["none", "ngram", "suffix"],
                    choices=list(CONFIGS))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--tool-choice", choices=["required", "cycle"], default="required",
                    help="cycle: each turn names the next tool (grep, read_file, run_tests)")
    ap.add_argument("--fixed-k", action="store_true",
                    help="speculation: fixed (always verify k drafts) instead of the config's")
    ap.add_argument("--k", type=int, default=None,
                    help="num_speculative_tokens for every drafting mode (default: its config's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", default=None, help="write runs and summary here")
    args = ap.parse_args(argv)
    if "none" not in args.drafts:
        args.drafts.insert(0, "none")  # the reference
    torch.set_num_threads(args.threads)
    configs = {}
    for draft in args.drafts:
        over: dict[str, Any] = {"draft": draft, "torch_threads": args.threads}
        if args.fixed_k and draft != "none":
            over["speculation"] = "fixed"
        if args.k is not None and draft != "none":
            over["num_speculative_tokens"] = args.k
        configs[draft] = load_config(CONFIGS[draft], over)
    print(f"{commit_label()}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
          f"turns {args.turns}, max_tokens {args.max_tokens}, tool_choice {args.tool_choice}, "
          f"reps {args.reps}, load average {os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.perf_counter()

    def measure(draft: str, rep: int) -> dict[str, Any]:
        run = asyncio.run(agent_loop(configs[draft], args.turns, args.max_tokens,
                                    args.tool_choice, TEMPLATE))
        s = summary([run])
        print(f"  rep {rep} {draft:6s}: {s['tokens_per_forward'][0]:.2f} tok/fwd, "
              f"{s['wall_s_per_turn'][0]:.2f} s/turn, load {run['load_s']:.1f} s, calls "
              f"{[c for t in run['turns'] for c in t['calls']]}", flush=True)
        return run

    runs = interleaved(args.drafts, args.reps, measure)
    reference = signature(runs["none"][0])
    mismatches = [(d, i) for d, rs in runs.items() for i, r in enumerate(rs)
                  if signature(r) != reference]
    rows, summaries = [], {}
    for draft, rs in runs.items():
        s = summaries[draft] = summary(rs)
        c = configs[draft]
        tpf = s["tokens_per_forward"]
        rows.append([draft, str(c.num_speculative_tokens),
                     c.speculation if draft != "none" else "-",
                     f"{statistics.median(tpf):.2f} ({min(tpf):.2f}-{max(tpf):.2f})",
                     f"{statistics.median(s['wall_s_per_turn']):.2f}",
                     f"{statistics.median(s['tokens_per_s']):.1f}",
                     "yes" if all((draft, i) not in mismatches for i in range(len(rs))) else
                     "MISMATCH"])
    first = runs["none"][0]["turns"]
    print(f"\nturn 1 prompt {first[0]['prompt_tokens']} tokens, last turn "
          f"{first[-1]['prompt_tokens']}; completion tokens per turn "
          f"{[t['tokens'] for t in first]}; finish {[t['finish'] for t in first]}")
    columns = ["draft", "k", "speculation", "tokens / forward, turns 2.. (median, range)",
               "s / turn (median)", "tokens / s", "calls = none's"]
    print(markdown_table(columns, rows))
    print(f"{time.perf_counter() - t0:.0f} s in all, load average {os.getloadavg()[0]:.2f} at "
          f"the end (wall times are this machine's, shared)")
    if args.json:
        write_json(args.json, {"meta": run_meta(args, time.perf_counter() - t0,
                                                threads=torch.get_num_threads()),
                               "summary": summaries, "runs": runs})
    for draft, i in mismatches:
        print(f"MISMATCH: {draft} rep {i}: {signature(runs[draft][i])} != none's {reference}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
