"""The engine stage: admission, scheduling and the step loop (engine → draft → verify → output)."""
