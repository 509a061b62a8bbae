"""Causal-context slices (docs/design.md §7): the small dependency-aware subgraph around a step's suspects."""

from teller.slicing.slice import Slice, SliceConfig, StepIndex, build_slice, comm_pairs_rows

__all__ = ["Slice", "SliceConfig", "StepIndex", "build_slice", "comm_pairs_rows"]
