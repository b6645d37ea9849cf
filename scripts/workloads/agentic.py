"""Write agentic.jsonl: agent-style traffic built from this repository's own text.

    .venv/bin/python scripts/workloads/agentic.py [--seed 0] [--out scripts/workloads/agentic.jsonl]

Three kinds, interleaved so that a request of each kind follows an earlier one it repeats:
- `code-edit`: rewrite a function from pipeline/ with one small change; every function is
  edited by several requests, so outputs repeat the same code across requests (and copy the
  prompt within one);
- `tool-call`: answer with one JSON tool call of a fixed shape about a repository file; the
  outputs share their structure and most of their tokens;
- `multi-turn`: a conversation quoting an earlier answer (a paragraph of the docs), asking to
  quote part of it back.

Same line format as the other workloads ({"id", "kind", "prompt"}), read by
scripts/bench_engine.py. Deterministic for a seed and the repository's content.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_FILES = ("pipeline/draft/ngram.py", "pipeline/protocol/messages.py", "pipeline/params.py",
              "pipeline/draft/none.py")
DOC_FILES = ("README.md", "docs/benchmarks.md", "docs/reliability.md")
EDITS = (
    "Rewrite this Python code exactly, but rename `{name}` to `{name}_value`. Output only the code.",
    ("Add a one-line comment above the first line of this function's body, otherwise keep the "
    "code exactly as it is. Output only the code."),
    ("Rewrite this Python code exactly as it is, but with 2-space indentation. Output only the "
    "code."),
)
TOOL_PROMPT = (
    "You are a coding agent. Tools: read_file(path, start_line, end_line), "
    "search(pattern, path). Reply with exactly one JSON object and nothing else, in this form:\n"
    '{{"tool": "read_file", "arguments": {{"path": "pipeline/params.py", "start_line": 1, '
    '"end_line": 20}}}}\n\nTask: {task}'
)
QUOTE_PROMPT = (
    "Earlier in this conversation:\n\nUser: What do the docs say about {topic}?\n\n"
    "Assistant: {answer}\n\nUser: {follow_up}"
)
FOLLOW_UPS = (
    ("Quote the first sentence of your previous answer word for word, then say it again in "
    "simpler words."),
    "Repeat your previous answer word for word, then add one sentence on why it matters.",
)


def functions(path: str, max_lines: int = 24) -> list[tuple[str, str]]:
    """(source, a name it assigns or takes) for each short function or method in `path`."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    out = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        src = ast.get_source_segment(text, node, padded=False)
        if src is None or not 3 <= src.count("\n") + 1 <= max_lines:
            continue
        names = [a.arg for a in node.args.args if a.arg != "self"]
        names += [t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Name)]
        if names:
            out.append((src, names[0]))
    return out


def paragraphs(path: str) -> list[str]:
    """Prose paragraphs of a Markdown file (no tables, code or headings), 200-700 chars."""
    with open(os.path.join(ROOT, path)) as f:
        blocks = re.split(r"\n\s*\n", re.sub(r"```.*?```", "", f.read(), flags=re.DOTALL))
    keep = []
    for b in blocks:
        b = " ".join(b.split())
        if 200 <= len(b) <= 700 and not b.startswith(("#", "|", "-", "*", "<")):
            keep.append(b)
    return keep


def code_edits(rng: random.Random, n: int) -> list[dict]:
    snippets = [s for path in CODE_FILES for s in functions(path)]
    rng.shuffle(snippets)
    rows = []
    per = len(EDITS)
    for i in range(n):
        src, name = snippets[(i // per) % len(snippets)]
        ask = EDITS[i % per].format(name=name)
        rows.append({"kind": "code-edit", "prompt": f"{ask}\n\n```python\n{src}\n```"})
    return rows


def tool_calls(rng: random.Random, n: int) -> list[dict]:
    files = sorted(os.path.relpath(os.path.join(d, f), ROOT)
                   for d, _, fs in os.walk(os.path.join(ROOT, "pipeline")) for f in fs
                   if f.endswith(".py"))
    rows = []
    for _ in range(n):
        path = rng.choice(files)
        with open(os.path.join(ROOT, path)) as f:
            lines = sum(1 for _ in f)
        start = rng.randint(1, max(1, lines - 20))
        task = (f"show me lines {start} to {start + rng.randint(5, 20)} of {path}"
                if rng.random() < 0.7 else f"find where `{os.path.basename(path)[:-3]}` is "
                f"imported under pipeline/ (use search)")
        rows.append({"kind": "tool-call", "prompt": TOOL_PROMPT.format(task=task)})
    return rows


def quotes(rng: random.Random, n: int) -> list[dict]:
    paras = [(p, path) for path in DOC_FILES if os.path.exists(os.path.join(ROOT, path))
             for p in paragraphs(path)]
    rng.shuffle(paras)
    rows = []
    for i in range(n):
        answer, path = paras[(i // 2) % len(paras)]  # each answer is quoted by two turns
        topic = os.path.basename(path).removesuffix(".md").lower()
        rows.append({"kind": "multi-turn",
                     "prompt": QUOTE_PROMPT.format(topic=topic, answer=answer,
                                                   follow_up=FOLLOW_UPS[i % 2])})
    return rows


def build(seed: int, per_kind: int) -> list[dict]:
    rng = random.Random(seed)
    kinds = [code_edits(rng, per_kind), tool_calls(rng, per_kind), quotes(rng, per_kind)]
    rows = [row for group in zip(*kinds) for row in group]
    return [{"id": f"agentic-{i}", **row} for i, row in enumerate(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-kind", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(ROOT, "scripts", "workloads", "agentic.jsonl"))
    args = ap.parse_args()
    rows = build(args.seed, args.per_kind)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
