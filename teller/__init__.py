"""TELLER: non-intrusive, cross-layer root-cause analysis for LLM inference services."""

__version__ = "0.1.0"
