"""Tracing plumbing every process shares; each stage makes its own spans where the work is."""
