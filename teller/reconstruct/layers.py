"""Layer tags and node names (docs/design.md §4), decided on the name dictionary, never per event.

The rules are data: :data:`KIND_LAYER` maps an event kind to its default layer, :data:`MESSAGE_TAGS`
maps the first word of an NVTX/RANGE message to a layer, and :data:`DEFAULT_STEP_PATTERNS` name
STEP ranges of foreign traces. A non-empty ``layer`` column (set by a reader from its own rules)
always wins.

Names: a tagged FE/BE/COMM message loses its tag word (``FE LlamaAttention`` → ``LlamaAttention``);
a STEP keeps its full message, so its id and request list stay visible.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from teller.errors import TellerError
from teller.rundir import IS_GPU_KIND, KIND_CODE, KINDS, LAYER_CODE  # noqa: F401 (IS_GPU_KIND: used as L.IS_GPU_KIND)

#: Default layer of each event kind when neither the ``layer`` column nor a message tag says more.
KIND_LAYER = {
    "NVTX_PUSH": "OTHER",
    "NVTX_POP": "OTHER",
    "RANGE": "OTHER",
    "MARKER": "OTHER",
    "RUNTIME": "RT",
    "DRIVER": "DRV",
    "KERNEL": "K",
    "MEMCPY": "MEM",
    "MEMSET": "MEM",
    "SYNC": "SYNC",
}

#: Kinds whose message may start with a tag word (our hooks write ``STEP ...``, ``FE ...``).
TAGGED_KINDS = ("NVTX_PUSH", "RANGE")

#: First word of a message → layer. Tags listed in :data:`STRIP_TAGS` are removed from the name.
MESSAGE_TAGS = {"STEP": "STEP", "FE": "FE", "BE": "BE", "COMM": "COMM", "OTHER": "OTHER"}
STRIP_TAGS = ("FE", "BE", "COMM", "OTHER")

#: Messages naming an engine step; group ``id`` = step number, optional group ``reqs`` = request
#: ids separated by commas. ``--step-pattern`` adds more (tried first).
DEFAULT_STEP_PATTERNS = (
    r"^STEP id=(?P<id>\d+)(?: reqs=(?P<reqs>\S*))?",
    r"^ProfilerStep#(?P<id>\d+)$",
)

#: Kinds that never contain other host events (they become leaves of the thread's tree).
LEAF_KINDS = ("MARKER",)

#: Host calls GPU activity may bind to, most preferred first (the runtime call a user wrote
#: before the driver call it issued).
LAUNCH_KINDS = ("RUNTIME", "DRIVER")

#: Order of host events that share start and end: ranges enclose calls, runtime encloses driver.
KIND_TIE_RANK = {
    "NVTX_PUSH": 0,
    "RANGE": 0,
    "RUNTIME": 1,
    "DRIVER": 2,
    "SYNC": 3,
    "MARKER": 4,
    "NVTX_POP": 5,
    "KERNEL": 5,
    "MEMCPY": 5,
    "MEMSET": 5,
}


def kind_table(table: dict[str, object], default: object, dtype) -> np.ndarray:
    """A lookup array indexed by kind code, built from a ``{kind: value}`` dict."""
    return np.array([table.get(k, default) for k in KINDS], dtype=dtype)


KIND_LAYER_CODE = kind_table({k: LAYER_CODE[v] for k, v in KIND_LAYER.items()}, LAYER_CODE["OTHER"], np.int8)
IS_TAGGED_KIND = kind_table({k: True for k in TAGGED_KINDS}, False, bool)
IS_LEAF_KIND = kind_table({k: True for k in LEAF_KINDS}, False, bool)
LAUNCH_PRIORITY = kind_table({k: i for i, k in enumerate(LAUNCH_KINDS)}, -1, np.int8)
TIE_RANK = kind_table(KIND_TIE_RANK, 5, np.int8)
STEP, COMM, OTHER = LAYER_CODE["STEP"], LAYER_CODE["COMM"], LAYER_CODE["OTHER"]
SYNC_KIND = KIND_CODE["SYNC"]


@dataclass
class NameRules:
    """Per entry of the input name dictionary: what its text says (all arrays index by code)."""

    tag_layer: np.ndarray  # int8 layer code from the tag word or a step pattern, -1 if none
    strip_code: np.ndarray  # int32 code into ``names`` of the name without its tag
    keep_code: np.ndarray  # int32 code into ``names`` of the unchanged name
    names: pa.Array  # output name dictionary (strings)
    step_num: np.ndarray  # int64 step number parsed from the text, -1 if none
    reqs: pa.Array  # request list text per code (null if none)
    comm_kernel: np.ndarray | None = None  # bool: a collective-communication kernel name (NCCL, RCCL)


#: GPU kernels of collective-communication libraries: the GPU side of a collective, layer COMM
#: (the same rule as the Kineto reader's ``layer_rules.toml``, for traces without a layer column,
#: e.g. CUPTI recordings of NCCL ranks)
COMM_KERNEL_PATTERN = r"^(nccl|rccl)(Dev)?Kernel"


def layer_codes(dictionary: pa.Array) -> np.ndarray:
    """Codes into :data:`LAYERS` for the input ``layer`` dictionary ("" → -1, unknown → OTHER)."""
    out = []
    for v in dictionary.to_pylist():
        v = (v or "").strip().upper()
        out.append(-1 if not v else LAYER_CODE.get(v, OTHER))
    return np.array(out or [-1], dtype=np.int8)


def _compile_check(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise TellerError(f"--step-pattern {pattern!r}: not a valid regular expression ({e}); fix the pattern") from None


def _extract(names: pa.Array, pattern: str) -> tuple[np.ndarray, pa.Array, pa.Array]:
    """(matched, id text, reqs text) of ``pattern`` on every dictionary entry."""
    n = len(names)
    rx = re.compile(pattern)
    groups = rx.groupindex
    try:  # vectorized (RE2) when the pattern allows it
        if "id" in groups or "reqs" in groups:
            st = pc.extract_regex(names, pattern)
            matched = st.is_valid().to_numpy(zero_copy_only=False)
            ids = st.field("id") if "id" in groups else pa.nulls(n, pa.string())
            reqs = st.field("reqs") if "reqs" in groups else pa.nulls(n, pa.string())
        else:
            matched = pc.match_substring_regex(names, pattern).to_numpy(zero_copy_only=False)
            ids = reqs = pa.nulls(n, pa.string())
        return np.asarray(matched, dtype=bool), ids, reqs
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    # Python regex syntax RE2 lacks (look-arounds, ...): loop over the dictionary, not over events.
    matched, ids, reqs = [], [], []
    for s in names.to_pylist():
        m = rx.search(s or "")
        matched.append(m is not None)
        d = m.groupdict() if m else {}
        ids.append(d.get("id"))
        reqs.append(d.get("reqs"))
    return np.array(matched, dtype=bool), pa.array(ids, pa.string()), pa.array(reqs, pa.string())


def _to_int(text: pa.Array) -> np.ndarray:
    """Digits → int64, anything else → -1."""
    text = pc.if_else(pc.match_substring_regex(text, r"^\d{1,18}$"), text, pa.scalar(None, pa.string()))
    return pc.fill_null(pc.cast(text, pa.int64()), -1).to_numpy(zero_copy_only=False)


def name_rules(dictionary: pa.Array, step_patterns: list[str] | None = None) -> NameRules:
    """Read tags, step numbers and request lists off the name dictionary (vectorized)."""
    names = pc.fill_null(dictionary.cast(pa.string()), "")
    n = len(names)
    tag_layer = np.full(n, -1, dtype=np.int8)
    stripped = names
    for tag, layer in MESSAGE_TAGS.items():
        hit = pc.starts_with(names, tag + " ").to_numpy(zero_copy_only=False)
        tag_layer[hit & (tag_layer < 0)] = LAYER_CODE[layer]
        if tag in STRIP_TAGS:
            cut = pc.utf8_slice_codeunits(names, len(tag) + 1)
            stripped = pc.if_else(pa.array(hit), cut, stripped)

    patterns = list(step_patterns or []) + list(DEFAULT_STEP_PATTERNS)
    step_num = np.full(n, -1, dtype=np.int64)
    reqs = pa.nulls(n, pa.string())
    seen = np.zeros(n, dtype=bool)
    for p in patterns:
        _compile_check(p)
        matched, ids, rq = _extract(names, p)
        new = matched & ~seen
        if not new.any():
            continue
        mask = pa.array(new)
        step_num = np.where(new, _to_int(pc.fill_null(ids, "")), step_num)
        reqs = pc.if_else(mask, rq, reqs)
        seen |= new
    tag_layer[seen] = STEP
    # A STEP message our patterns did not parse: fall back to "id=N", then to a trailing number.
    for fallback in (r"\bid=(?P<id>\d+)", r"(?P<id>\d+)\s*$"):
        todo = (tag_layer == STEP) & (step_num < 0)
        if not todo.any():
            break
        matched, ids, _ = _extract(names, fallback)
        step_num = np.where(todo & matched, _to_int(pc.fill_null(ids, "")), step_num)

    both = pa.concat_arrays([names, stripped]).dictionary_encode()
    codes = both.indices.to_numpy(zero_copy_only=False).astype(np.int32)
    comm_kernel = np.asarray(pc.match_substring_regex(names, COMM_KERNEL_PATTERN).to_numpy(zero_copy_only=False), bool)
    return NameRules(
        comm_kernel=comm_kernel,
        tag_layer=tag_layer,
        keep_code=codes[:n],
        strip_code=codes[n:],
        names=both.dictionary,
        step_num=step_num,
        reqs=reqs,
    )


def assign(kind: np.ndarray, layer_in: np.ndarray, name_code: np.ndarray, rules: NameRules) -> tuple[np.ndarray, np.ndarray]:
    """Layer code and output name code of every event.

    ``layer_in`` is the per-event input layer code (-1 = empty). Order of precedence: the input
    column, then a tag word or step pattern in the message (push/RANGE only), then the kind
    (a kernel named like an NCCL/RCCL kernel is COMM, any other kernel K).
    """
    tag = rules.tag_layer[name_code] if len(name_code) else np.zeros(0, np.int8)
    tagged = IS_TAGGED_KIND[kind]
    from_tag = tagged & (tag >= 0)
    by_kind = KIND_LAYER_CODE[kind]
    if rules.comm_kernel is not None and len(name_code):
        by_kind = np.where((kind == KIND_CODE["KERNEL"]) & rules.comm_kernel[name_code], LAYER_CODE["COMM"], by_kind)
    layer = np.where(layer_in >= 0, layer_in, np.where(from_tag, tag, by_kind)).astype(np.int8)
    strip = tagged & (tag == layer) & (layer != STEP) & (tag >= 0)
    name = np.where(strip, rules.strip_code[name_code], rules.keep_code[name_code]).astype(np.int32)
    return layer, name
