"""Fixtures for tests and benchmarks, shipped so both can use them: synthetic engine runs
(:mod:`.synth`) and runs with planted anomalies and their ground truth (:mod:`.planted`).
Nothing in the pipeline imports this package."""
