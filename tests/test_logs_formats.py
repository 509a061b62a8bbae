"""Log format presets and timestamp parsing."""

from __future__ import annotations

import calendar

import numpy as np
import pyarrow as pa
import pytest

from teller.errors import TellerError
from teller.logs.formats import (
    PRESETS_DATA,
    all_presets,
    custom_preset,
    days_from_civil,
    detect,
    parse_timestamps,
    preset,
    time_format_regex,
)

S = 1_000_000_000


def utc_ns(y, mo, d, h=0, mi=0, s=0, frac_ns=0):
    return calendar.timegm((y, mo, d, h, mi, s)) * S + frac_ns


REF_2026 = utc_ns(2026, 11, 29, 8)

# real-looking lines, one list per preset: (line, ts text, level, logger, message, pid)
SAMPLES = {
    "vllm": [
        ("INFO 11-29 08:15:02 [engine.py:123] Added request chatcmpl-abc123.",
         "11-29 08:15:02", "INFO", "engine.py", "Added request chatcmpl-abc123.", ""),
        ("(EngineCore_DP0 pid=1234) INFO 11-29 08:15:02 [core.py:87] Initializing a V1 LLM engine (v0.11.2) with config: model='m'",
         "11-29 08:15:02", "INFO", "core.py", "Initializing a V1 LLM engine (v0.11.2) with config: model='m'", "1234"),
        ("(APIServer pid=11980) WARNING 02-12 19:33:44 [interface.py:470] Using 'pin_memory=False' as WSL is detected.",
         "02-12 19:33:44", "WARNING", "interface.py", "Using 'pin_memory=False' as WSL is detected.", "11980"),
        ("(EngineCore_DP0 pid=948) DEBUG 09-17 17:43:05 [distributed/.../v1/nixl_connector.py:630] NIXL handshake: add agent took: 0.147",
         "09-17 17:43:05", "DEBUG", "distributed/.../v1/nixl_connector.py", "NIXL handshake: add agent took: 0.147", "948"),
        ("(Worker_TP2 pid=54584) INFO 01-15 03:17:56 [nixl_connector.py:114] NIXL is available",
         "01-15 03:17:56", "INFO", "nixl_connector.py", "NIXL is available", "54584"),
        ("INFO 11-29 08:15:02 llm_engine.py:222] Initializing an LLM engine (v0.4.0)",
         "11-29 08:15:02", "INFO", "llm_engine.py", "Initializing an LLM engine (v0.4.0)", ""),
    ],
    "python": [
        ("2026-11-29 08:15:02,123 - vllm.engine - INFO - Added request cmpl-9f8e.",
         "2026-11-29 08:15:02,123", "INFO", "vllm.engine", "Added request cmpl-9f8e.", ""),
        ("2026-11-29 08:15:03,007 - root - ERROR - request_id=r-7 failed: CUDA out of memory",
         "2026-11-29 08:15:03,007", "ERROR", "root", "request_id=r-7 failed: CUDA out of memory", ""),
    ],
    "transformers": [
        ("[INFO|continuous_api.py:1291] 2026-11-29 08:15:02,123 >> Warming up for continuous batching...",
         "2026-11-29 08:15:02,123", "INFO", "continuous_api.py", "Warming up for continuous batching...", ""),
        ("[WARNING|continuous_api.py:949] 2026-11-29 08:15:04,500 >> Queue full. Request with ids ['req_3'] will be dropped.",
         "2026-11-29 08:15:04,500", "WARNING", "continuous_api.py", "Queue full. Request with ids ['req_3'] will be dropped.", ""),
    ],
    "transformers_detail": [
        ("INFO [transformers.generation.continuous_batching.cache:207] 2026-11-29 08:15:02,123 Paged cache initialized: self.num_sectors = 4",
         "2026-11-29 08:15:02,123", "INFO", "transformers.generation.continuous_batching.cache",
         "Paged cache initialized: self.num_sectors = 4", ""),
    ],
    "sglang": [
        ("[2026-11-29 08:15:02 TP0] Prefill batch. #new-seq: 1, #new-token: 7",
         "2026-11-29 08:15:02", "", "TP0", "Prefill batch. #new-seq: 1, #new-token: 7", ""),
    ],
    "iso8601": [
        ("2026-11-29T08:15:02.123456Z INFO serving request req_12",
         "2026-11-29T08:15:02.123456Z", "INFO", "", "serving request req_12", ""),
        ("2026-11-29 09:15:02+01:00 [ERROR] worker died",
         "2026-11-29 09:15:02+01:00", "ERROR", "", "worker died", ""),
    ],
    "transformers_default": [
        ("[transformers] Warming up completed in 1.52s.", None, "", "transformers", "Warming up completed in 1.52s.", ""),
    ],
}


def test_every_preset_has_samples():
    assert set(SAMPLES) == set(PRESETS_DATA)


@pytest.mark.parametrize("name", list(PRESETS_DATA))
def test_preset_parses_its_lines(name):
    p = preset(name)
    lines = pa.array([s[0] for s in SAMPLES[name]])
    assert p.re2  # runs as one Arrow pass
    assert p.match_mask(lines).all()
    ext = p.extract(lines)
    for i, (_, ts, level, logger, msg, pid) in enumerate(SAMPLES[name]):
        if ts is not None:
            assert ext["ts"][i].as_py() == ts
        empty = pa.array([""] * len(lines))
        assert ext.get("level", empty)[i].as_py() == level
        assert ext.get("logger", empty)[i].as_py() == logger
        assert ext["msg"][i].as_py() == msg
        if "pid" in ext:
            assert ext["pid"][i].as_py() == pid
    assert detect(lines, all_presets()).name == name


def test_presets_do_not_match_continuation_lines():
    lines = pa.array(['Traceback (most recent call last):', '  File "x.py", line 3, in f',
                      "ValueError: boom", "plain text 2026"])
    for p in all_presets():
        assert not p.match_mask(lines).any(), p.name


def test_vllm_time_without_year_takes_the_reference_year_and_utc_offset():
    ts = pa.array(["11-29 08:15:02", "12-31 23:59:59", "01-01 00:00:01"])
    wall, res = parse_timestamps(ts, "%m-%d %H:%M:%S", REF_2026, 0)
    assert wall[0] == utc_ns(2026, 11, 29, 8, 15, 2)
    assert res.tolist() == [S] * 3
    # reference on New Year's Eve: January lines belong to the next year
    ref = utc_ns(2026, 12, 31, 23, 59)
    wall, _ = parse_timestamps(ts, "%m-%d %H:%M:%S", ref, 0)
    assert wall[1] == utc_ns(2026, 12, 31, 23, 59, 59)
    assert wall[2] == utc_ns(2027, 1, 1, 0, 0, 1)
    # local time two hours ahead of UTC
    wall, _ = parse_timestamps(ts.slice(0, 1), "%m-%d %H:%M:%S", REF_2026, 7200)
    assert wall[0] == utc_ns(2026, 11, 29, 6, 15, 2)


def test_python_logging_millis_and_iso_offsets():
    wall, res = parse_timestamps(pa.array(["2026-11-29 08:15:02,123"]), "%Y-%m-%d %H:%M:%S,%f", 0, 0)
    assert wall[0] == utc_ns(2026, 11, 29, 8, 15, 2, 123_000_000)
    assert res[0] == 1_000_000
    ts = pa.array(["2026-11-29T08:15:02.123456Z", "2026-11-29 09:15:02+01:00", "2026-11-29T08:15:02",
                   "2026-11-29T08:15:02.5-0230"])
    wall, res = parse_timestamps(ts, "ISO8601", 0, 3600)
    assert wall[0] == utc_ns(2026, 11, 29, 8, 15, 2, 123_456_000)
    assert wall[1] == utc_ns(2026, 11, 29, 8, 15, 2)
    assert wall[2] == utc_ns(2026, 11, 29, 7, 15, 2)  # naive: the given offset applies
    assert wall[3] == utc_ns(2026, 11, 29, 10, 45, 2, 500_000_000)
    assert res.tolist() == [1000, S, S, 100_000_000]


def test_strptime_directives():
    wall, _ = parse_timestamps(pa.array(["Nov 29 2026 08:15:02 PM"]), "%b %d %Y %I:%M:%S %p", 0, 0)
    assert wall[0] == utc_ns(2026, 11, 29, 20, 15, 2)
    wall, _ = parse_timestamps(pa.array(["1795940102.25"]), "EPOCH", 0, 0)
    assert wall[0] == 1795940102 * S + 250_000_000
    wall, _ = parse_timestamps(pa.array(["29/11/26 08:15:02"]), "%d/%m/%y %H:%M:%S", 0, 0)
    assert wall[0] == utc_ns(2026, 11, 29, 8, 15, 2)
    # impossible dates are reported as unparseable, not guessed
    wall, _ = parse_timestamps(pa.array(["2026-13-01 00:00:00,000", "garbage"]), "%Y-%m-%d %H:%M:%S,%f", 0, 0)
    assert wall.tolist() == [-1, -1]
    with pytest.raises(TellerError, match="not supported"):
        time_format_regex("%Q")


def test_days_from_civil_matches_calendar():
    rng = np.random.default_rng(0)
    y = rng.integers(1900, 2200, 200)
    m = rng.integers(1, 13, 200)
    d = rng.integers(1, 29, 200)
    ref = [calendar.timegm((int(a), int(b), int(c), 0, 0, 0)) // 86400 for a, b, c in zip(y, m, d, strict=True)]
    assert days_from_civil(y, m, d).tolist() == ref


def test_custom_regex_with_python_only_syntax_falls_back_to_re():
    # a look-behind is not RE2: the preset still works, through Python re
    p = custom_preset(r"^(?P<ts>\S+ \S+) (?<=\d )(?P<level>[A-Z]+) (?P<msg>.*)$", "%Y-%m-%d %H:%M:%S")
    assert not p.re2
    lines = pa.array(["2026-11-29 08:15:02 INFO hello", "no"])
    assert p.match_mask(lines).tolist() == [True, False]
    assert p.extract(lines)["msg"].to_pylist() == ["hello", ""]


def test_custom_regex_needs_time_format_and_valid_pattern():
    with pytest.raises(TellerError, match="time format"):
        custom_preset(r"^(?P<ts>\S+) (?P<msg>.*)$", None)
    with pytest.raises(TellerError, match="invalid regex"):
        custom_preset(r"^(?P<ts>\S+", "%s")
    with pytest.raises(TellerError, match="unknown log format"):
        preset("nope")
