"""Adaptive speculation: `estimate`, `cost`, `plan`, the controller (`policy`), its `record`."""
