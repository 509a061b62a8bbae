"""Workloads the project ships: the engine the recordings and fault campaigns run on.

``teller workload serve`` (or ``python -m teller.workload serve``) drives transformers
continuous batching with a seeded random Llama and Poisson arrivals (:mod:`teller.workload.serve`).
"""
