"""Tracing plumbing every process shares: OpenTelemetry set-up and W3C context (`otel`), the
span and attribute names writers and readers share (`schema`), the JSON-lines trace file
(`trace_file`) and the `specrelay trace` reader (`cli`). It makes no spans of its own: each stage
makes its spans where the work is (the output stage's: pipeline/output/spans.py; the engine's
step span: pipeline/engine/core.py)."""
