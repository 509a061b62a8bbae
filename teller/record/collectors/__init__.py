"""Collectors: where GPU/host activity comes from while a process is recorded."""
