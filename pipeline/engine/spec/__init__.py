"""Adaptive speculation, by job: `estimate` (per-position acceptance), `cost` (step-cost model),
`plan` (pure planning math), `policy` (the controller the scheduler asks each step), `record`
(why a step's k was chosen, for traces). Settings live below the engine, in
pipeline.spec_settings."""
