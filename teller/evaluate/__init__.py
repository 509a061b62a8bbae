"""Evaluation (DESIGN.md §11): metrics that score diagnoses against ground truth."""
