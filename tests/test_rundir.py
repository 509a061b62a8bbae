"""The canonical event table helpers and the per-process sink."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from teller.record.sink import EventSink
from teller.rundir import RunDir, events_table, flag_counts, kind_counts


def test_repetitive_dictionary_with_wide_indices_is_reencoded():
    # 300 dictionary entries holding only 3 distinct layer tags: indices do not fit int8 as given
    dictionary = pa.array(["STEP", "FE", "BE"] * 100)
    idx = np.arange(300, dtype=np.int32)
    layer = pa.DictionaryArray.from_arrays(pa.array(idx), dictionary)
    t = events_table({"kind": np.full(300, 2, np.int8), "name": layer, "layer": layer,
                      "start_ns": idx, "end_ns": idx})
    assert t.column("layer").to_pylist() == dictionary.to_pylist()
    assert t.schema.field("layer").type == pa.dictionary(pa.int8(), pa.string())
    assert kind_counts(t) == {"RANGE": 300}


def test_sink_counts_rows_it_cannot_take(tmp_path):
    sink = EventSink(tmp_path / "run")
    sink.append({"kind": ["NOT_A_KIND"], "name": ["x"], "start_ns": [1], "end_ns": [2]})
    sink.append({"kind": ["RANGE"], "name": ["FE a"], "start_ns": [1], "end_ns": [2]})
    sink.close()
    info = sink.info()
    assert info["dropped_rows"] == 1 and info["rows_written"] == 1 and info["errors"]
    assert RunDir(tmp_path / "run").read_events().num_rows == 1


def test_flag_counts():
    assert flag_counts(np.array([0, 1, 3, 4])) == {"repaired": 2, "truncated": 1, "unbound": 1}
