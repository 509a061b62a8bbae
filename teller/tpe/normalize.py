"""Name normalization for TPE symbols (docs/design.md §8): rules as data, applied per distinct name.

A symbol is the node's layer tag and its normalized name, ``"K at::native::elementwise_kernel"``.
Normalization removes what differs between instances of the same operation (step numbers,
request ids, byte counts, template arguments, hex ids, tile sizes) so that the vocabulary counts
operations, not instances. Rules run in order; each names the layers it applies to (empty: all).
They are stored in ``tokenizer_config.json`` so a saved tokenizer normalizes exactly as it did
when it was trained. Kinds:

- ``regex``: ``re.sub(pattern, replacement, name)``.
- ``demangle``: Itanium C++ names (``_Z...``) through ``c++filt`` when it is on PATH (one call
  for all distinct names), else a small built-in demangler that recovers the qualified function
  name (what survives the template and argument rules anyway).
- ``signature``: for names that look like C++ signatures (``ret ns::f<...>(args) const``): drop the
  parameter list and the return type.
- ``strip_balanced``: remove bracketed groups (``<...>``), nesting aware.

Everything runs on the dictionary of distinct names (hundreds to thousands), never per event.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from teller.rundir import LAYERS

NORMALIZATION_VERSION = 1

#: Characters TPE uses to write merged tokens (``a ⟨b⟩ · c``, ``… ⟪id⟫``); replaced in names.
RESERVED = "⟨⟩·⟪⟫"


@dataclass(frozen=True)
class Rule:
    """One normalization step. ``layers`` empty: every layer."""

    id: str
    kind: str  # regex | demangle | signature | strip_balanced
    pattern: str = ""
    replacement: str = ""
    layers: tuple[str, ...] = ()
    doc: str = ""

    def to_json(self) -> dict:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Rule":
        return cls(**{**d, "layers": tuple(d.get("layers", ()))})


_TAGS = "|".join(LAYERS)

#: The default rules, in order.
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("tag-prefix", "regex", rf"^(?:{_TAGS})\s+", "", (),
         "TELLER's hooks write the layer tag into the NVTX message (`FE LlamaAttention`); the tag is already the symbol's first part"),
    Rule("key-values", "regex", r"\s*(?<![\w.])(?!group=)[A-Za-z_][\w.]*=\S*", "", (),
         "per-instance arguments such as `id=12 reqs=req_0,req_3` or `bytes=8192 seq=17`; `group=` (which process group) is kept"),
    Rule("demangle", "demangle", "", "", (),
         "Itanium-mangled C++ names (`_Z...`): c++filt when present, else the built-in demangler"),
    Rule("anonymous-namespace", "regex", r"\(anonymous namespace\)::", "", (),
         "`(anonymous namespace)::` says nothing about the operation"),
    Rule("signature", "signature", "", "", (),
         "C++ signatures: keep the qualified name, drop the parameter list and the return type (`void f<...>(int)` → `f<...>`)"),
    Rule("templates", "strip_balanced", "<>", "", (),
         "template arguments (`elementwise_kernel<128, 4, ...>` → `elementwise_kernel`)"),
    Rule("hex", "regex", r"0[xX][0-9a-fA-F]+|(?<![\w])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}(?![\w])", "#", (),
         "hex ids and addresses (`0x7f3a...`; words of 8 or more hex digits with a letter and a digit)"),
    Rule("dims", "regex", r"\d+(?:x\d+)+", "#", (),
         "tile and shape tuples (`64x128x64` → `#`)"),
    Rule("numbers", "regex", r"(?<![A-Za-z0-9])\d+", "#", (),
         "numbers not glued to a word (`knob_7` → `knob_#`, `step#3` → `step#`); `sm90`, `conv2d`, `bf16` keep theirs"),
    Rule("hash-runs", "regex", r"#+", "#", (), "collapse `##` left by the rules above"),
    Rule("reserved", "regex", f"[{RESERVED}]", "/", (), "characters TPE uses to write merged tokens"),
    Rule("space", "regex", r"\s+", " ", (), "collapse white space"),
)


# --------------------------------------------------------------------------------------------
# demangling


def _cxxfilt(names: list[str]) -> list[str] | None:
    """Demangle with c++filt (one process for all names); None when it is missing or fails."""
    exe = shutil.which("c++filt")
    if not exe or not names:
        return None
    try:
        out = subprocess.run([exe], input="\n".join(names) + "\n", capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.split("\n")[: len(names)]
    return lines if len(lines) == len(names) else None


_OPERATORS = {"cl": "operator()", "ix": "operator[]", "eq": "operator==", "pl": "operator+", "mi": "operator-", "ml": "operator*", "dv": "operator/", "aS": "operator="}


def mini_demangle(name: str) -> str | None:
    """The qualified function name of an Itanium-mangled symbol, or None when not understood.

    Enough for kernel names: ``_ZN2at6native18elementwise_kernelILi128ELi4E...EEvT_`` →
    ``at::native::elementwise_kernel``. Template arguments and the parameter list are skipped
    (normalization removes them anyway); substitutions inside them do not matter.
    """
    if not name.startswith("_Z"):
        return None
    s, i = name, 2
    if i < len(s) and s[i] == "L":
        i += 1
    parts: list[str] = []

    def source_name(i: int) -> tuple[str | None, int]:
        j = i
        while j < len(s) and s[j].isdigit():
            j += 1
        if j == i:
            return None, i
        n = int(s[i:j])
        if j + n > len(s):
            return None, i
        return s[j : j + n], j + n

    def skip_group(i: int) -> int:
        """From an opening code (I, X, L, N, Z, F, J or Ul) to just after its matching E."""
        depth = 0
        while i < len(s):
            c = s[i]
            if c.isdigit():  # a source name inside: skip it whole (its letters are not structure)
                nm, j = source_name(i)
                if nm is None:
                    return -1
                i = j
                continue
            if c in "ST" and i + 1 < len(s) and (s[i + 1] == "_" or s[i + 1].isdigit() or s[i + 1].isupper()):
                j = s.find("_", i)  # substitution S_, S0_, T_, T1_
                if j < 0:
                    return -1
                i = j + 1
                continue
            if c in "IXLNZFJ" or (c == "U" and s.startswith("Ul", i)):
                depth += 1
            elif c == "E":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return -1

    if i < len(s) and s[i] == "N":
        i += 1
        while i < len(s) and s[i] in "rVKRO":
            i += 1
        while i < len(s) and s[i] != "E":
            if s.startswith("St", i):
                parts.append("std")
                i += 2
            elif s[i] == "I":
                i = skip_group(i)
                if i < 0:
                    return None
            elif s[i] in "CD" and i + 1 < len(s) and s[i + 1].isdigit():
                base = parts[-1] if parts else ""
                parts.append(("~" if s[i] == "D" else "") + base)
                i += 2
            elif s[i] == "S":  # substitution: S_, S0_, ...
                j = s.find("_", i)
                if j < 0:
                    return None
                i = j + 1
            elif s[i:i + 2] in _OPERATORS:
                parts.append(_OPERATORS[s[i:i + 2]])
                i += 2
            elif s[i] == "U" and s.startswith("Ut", i):  # unnamed type
                j = s.find("_", i)
                if j < 0:
                    return None
                parts.append("{unnamed}")
                i = j + 1
            else:
                nm, j = source_name(i)
                if nm is None:
                    return None
                parts.append(nm)
                i = j
        if i >= len(s):  # a nested name ends with E; this one was cut short
            return None
        return "::".join(parts) or None
    if s.startswith("St", i):
        i += 2
        parts.append("std")
    nm, _ = source_name(i)
    if nm is None:
        return None
    parts.append(nm)
    return "::".join(parts)


def demangle(names: list[str]) -> list[str]:
    """Demangle the mangled ones among ``names`` (others unchanged)."""
    idx = [k for k, n in enumerate(names) if n.startswith("_Z")]
    if not idx:
        return list(names)
    out = list(names)
    mangled = [names[k] for k in idx]
    done = _cxxfilt(mangled)
    for k, m, d in zip(idx, mangled, done or [None] * len(idx), strict=True):
        if d is None or d == m:
            d = mini_demangle(m)
        out[k] = d if d else m
    return out


# --------------------------------------------------------------------------------------------
# signatures and bracketed groups


def _matching_open(s: str, close_at: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for k in range(close_at, -1, -1):
        if s[k] == close_ch:
            depth += 1
        elif s[k] == open_ch:
            depth -= 1
            if depth == 0:
                return k
    return -1


def strip_signature(name: str) -> str:
    """``void ns::f<int>(float*, int) const`` → ``ns::f<int>``; names without a trailing
    parameter list are returned unchanged."""
    s = name.strip()
    s = re.sub(r"\s+(?:const|volatile|noexcept|&&|&)\s*$", "", s)
    if not s.endswith(")"):
        return name
    k = _matching_open(s, len(s) - 1, "(", ")")
    if k <= 0:
        return name
    head = s[:k].rstrip()
    # the return type: everything before the last top-level space (outside <...>)
    depth = 0
    cut = -1
    for j, c in enumerate(head):
        if c in "<(":
            depth += 1
        elif c in ">)":
            depth -= 1
        elif c == " " and depth == 0:
            cut = j
    return head[cut + 1 :] if cut >= 0 else head


def strip_balanced(name: str, pair: str) -> str:
    """Remove every ``pair[0] ... pair[1]`` group, nesting aware (``operator<`` style names with an
    unmatched bracket are left alone)."""
    o, c = pair[0], pair[1]
    if o not in name:
        return name
    out = []
    depth = 0
    for ch in name:
        if ch == o:
            depth += 1
        elif ch == c and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return name if depth else "".join(out)


# --------------------------------------------------------------------------------------------


class Normalizer:
    """Applies a rule list to names; ``symbols(layers, names)`` gives ``"TAG name"`` strings."""

    def __init__(self, rules: Sequence[Rule] | None = None):
        self.rules = tuple(rules if rules is not None else DEFAULT_RULES)
        self._compiled = [re.compile(r.pattern) if r.kind == "regex" else None for r in self.rules]
        for r in self.rules:
            if r.kind not in ("regex", "demangle", "signature", "strip_balanced"):
                raise ValueError(f"unknown normalization rule kind {r.kind!r} in rule {r.id!r}")

    def to_json(self) -> dict:
        return {"version": NORMALIZATION_VERSION, "rules": [r.to_json() for r in self.rules]}

    @classmethod
    def from_json(cls, d: dict) -> "Normalizer":
        return cls([Rule.from_json(r) for r in d["rules"]])

    def names(self, layers: Sequence[str], names: Sequence[str]) -> list[str]:
        """Normalized names of (layer, name) pairs (call on distinct pairs)."""
        out = [n or "" for n in names]
        for rule, rx in zip(self.rules, self._compiled, strict=True):
            sel = [k for k, lay in enumerate(layers) if not rule.layers or lay in rule.layers]
            if not sel:
                continue
            if rule.kind == "demangle":
                done = demangle([out[k] for k in sel])
                for k, v in zip(sel, done, strict=True):
                    out[k] = v
                continue
            for k in sel:
                v = out[k]
                if rule.kind == "regex":
                    v = rx.sub(rule.replacement, v)
                elif rule.kind == "signature":
                    v = strip_signature(v)
                else:
                    v = strip_balanced(v, rule.pattern)
                out[k] = v
        return [v.strip() for v in out]

    def symbols(self, layers: Sequence[str], names: Sequence[str]) -> list[str]:
        """``"TAG name"`` (or just ``"TAG"`` when the name normalizes to nothing)."""
        return [f"{lay} {n}" if n else lay for lay, n in zip(layers, self.names(layers, names), strict=True)]


def symbol_layer(symbol: str) -> str:
    """The layer tag of a symbol string."""
    return symbol.split(" ", 1)[0]


def normalize(layers: Iterable[str], names: Iterable[str], rules: Sequence[Rule] | None = None) -> list[str]:
    """Convenience: symbols for (layer, name) pairs with the default (or given) rules."""
    return Normalizer(rules).symbols(list(layers), list(names))
