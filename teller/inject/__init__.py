"""Fault injection (docs/design.md §10): campaigns of recorded runs with ground-truth windows.

- :mod:`.spec` parses and validates a campaign spec (TOML);
- :mod:`.mechanisms` holds one class per mechanism in a registry (category, magnitude knob,
  targeted operators, what it needs to run);
- :mod:`.agent` runs inside the recorded engine process (the campaign names it in the recording's
  extensions, :data:`AGENT_EXTENSION`, and passes the plan in ``TELLER_FAULTS``) and applies the plan through post-import hooks, or starts the
  co-located processes of :mod:`.hogs` beside the engine; it writes the windows it actually
  applied, on the run's time base τ, to ``RUN/inject/<pid>.json``;
- :mod:`.campaign` records each run with ``teller record`` and writes ``labels.json``;
- :mod:`.labels` turns windows plus the measured effect into per-step labels and explanations.

Nothing here edits the engine: mechanisms act through hooks or beside it.
"""

#: The five fault types (docs/design.md §10), in label order.
CATEGORIES = ("memory", "kernel", "runtime", "communication", "scheduling")
CATEGORY_TITLES = {
    "memory": "memory/resource",
    "kernel": "CUDA/kernel",
    "runtime": "runtime/driver",
    "communication": "communication/network",
    "scheduling": "scheduling/software",
}
#: the next step of a fault type whose mechanism is not named (``teller diagnose``'s explanation)
CATEGORY_ACTIONS = {
    "memory": "check the GPU memory, bandwidth and host CPU used by the engine and by co-located processes",
    "kernel": "check the named operator's kernels against a fault-free run",
    "runtime": "check the step's runtime calls (synchronizations, allocations, copies) with `teller show`",
    "communication": "check the ranks' step times and the interconnect between them",
    "scheduling": "check the engine loop and the scheduler between and around the flagged steps",
}
ENV_FAULTS = "TELLER_FAULTS"
#: what the recording bootstrap calls in each recorded process of a campaign run (its runtime as
#: argument): the fault agent's installer (``teller.record.launcher.record(extensions=...)``)
AGENT_EXTENSION = "teller.inject.agent:install"
