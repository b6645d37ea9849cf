"""The parts of scripts/bench_engine.py, one job a module: the workloads and their requests
(`workloads`), the in-process stages' timers (`stages`), a request as the client saw it
(`traces`), one cell's result from its segments (`results`), the engines under test (`local`,
`ray_row`, `hf`), the reference checks (`checks`) and the report (`report`, `plots`). The shared
machinery (statistics, CPU time, tree state, result files) is scripts/harness.py."""
