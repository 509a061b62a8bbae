"""Engine instrumentors against fake module trees (vLLM, SGLang) and the installed transformers.

vLLM and SGLang do not install on the CPU machine; these trees mimic the module, class and
method names the instrumentors hook (docs/design.md §13), so what is tested is the wrapping logic,
the request-id extraction and the version gate, not compatibility with a real release.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from teller.errors import InputError
from teller.record import ranges, runtime
from teller.record.instrument.generic import GenericInstrumentor, RequestPath, load_hooks
from teller.record.instrument.sglang import SGLangInstrumentor
from teller.record.instrument.vllm import VLLMInstrumentor

VLLM_FILES = {
    "vllm/__init__.py": "__version__ = '{version}'\n",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/sched/__init__.py": "",
    "vllm/v1/worker/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/v1/core/sched/scheduler.py": """
        class NewRequestData:
            def __init__(self, req_id):
                self.req_id = req_id

        class SchedulerOutput:
            def __init__(self, scheduled, new=()):
                self.num_scheduled_tokens = scheduled
                self.total_num_scheduled_tokens = sum(scheduled.values())
                self.scheduled_new_reqs = [NewRequestData(r) for r in new]
                self.preempted_req_ids = set()

        class BlockPool:
            num_gpu_blocks = 64
            def get_num_free_blocks(self):
                return 60

        class KVCacheManager:
            block_pool = BlockPool()

        class Scheduler:
            def __init__(self, batches):
                self.batches = list(batches)
                self.waiting = ["w1", "w2", "w3"]
                self.kv_cache_manager = KVCacheManager()
            def has_requests(self):
                return bool(self.batches)
            def schedule(self):
                return SchedulerOutput(self.batches.pop(0))
    """,
    "vllm/v1/worker/gpu_worker.py": """
        class Worker:
            def execute_model(self, scheduler_output):
                return None  # sampling follows in sample_tokens, as in recent V1 workers
            def sample_tokens(self, grammar_output):
                return "tokens"
    """,
    "vllm/v1/engine/core.py": """
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.worker.gpu_worker import Worker

        class EngineCore:
            def __init__(self, batches, batch_queue=False):
                self.scheduler = Scheduler(batches)
                self.worker = Worker()
                self.step_fn = self.step_with_batch_queue if batch_queue else self.step
            def step(self):
                if not self.scheduler.has_requests():
                    return {}, False
                out = self.scheduler.schedule()
                self.worker.execute_model(out)
                return self.worker.sample_tokens(None), True
            def step_with_batch_queue(self):
                return self.step()
    """,
    "vllm/distributed/parallel_state.py": """
        class GroupCoordinator:
            def __init__(self, name, world_size):
                self.unique_name, self.world_size = name, world_size
            def all_reduce(self, input_):
                return input_
    """,
}

SGLANG_FILES = {
    "sglang/__init__.py": "__version__ = '{version}'\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/scheduler.py": """
        class Req:
            def __init__(self, rid):
                self.rid = rid

        class ForwardMode:
            def __init__(self, extend):
                self.extend = extend
            def is_extend(self):
                return self.extend
            def is_decode(self):
                return not self.extend

        class ScheduleBatch:
            def __init__(self, rids, extend=False):
                self.reqs = [Req(r) for r in rids]
                self.forward_mode = ForwardMode(extend)
                self.extend_num_tokens = 7 * len(rids)

        class Allocator:
            def available_size(self):
                return 100

        class Scheduler:
            waiting_queue = ["x"]
            max_total_num_tokens = 128
            token_to_kv_pool_allocator = Allocator()
            def run_batch(self, batch):
                return len(batch.reqs)
    """,
}


def make_tree(root: Path, files: dict[str, str], version: str) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).replace("{version}", version))


@pytest.fixture()
def fake_engine(tmp_path: Path):
    """Yields a function (files, version) → None that installs a fake package tree; cleans up."""
    made: list[str] = []

    def install(files: dict[str, str], version: str) -> None:
        make_tree(tmp_path, files, version)
        made.append(next(iter(files)).split("/")[0])

    sys.path.insert(0, str(tmp_path))
    ranges.RECORDER.drain(final=True)
    yield install
    sys.path.remove(str(tmp_path))
    for top in made:
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]
    ranges.RECORDER.drain(final=True)


def names() -> list[str]:
    cols = ranges.RECORDER.drain()
    return [] if cols is None else cols["name"].to_pylist()


@pytest.mark.parametrize("batch_queue", [False, True])
def test_vllm_engine_steps_carry_scheduled_request_ids(fake_engine, batch_queue):
    fake_engine(VLLM_FILES, "0.11.0")
    inst = VLLMInstrumentor()
    inst.instrument(runtime)
    try:
        from vllm.v1.engine.core import EngineCore  # imported after instrument(): hooked on import

        core = EngineCore([{"req_a-1a2b3c4d": 5, "req_b-99887766": 1}, {"req_b-99887766": 1}], batch_queue=batch_queue)
        while core.step_fn()[1]:
            pass
        got = names()
        steps = sorted(n for n in got if n.startswith("STEP"))
        assert len(steps) == 2
        assert steps[0].endswith("reqs=req_a-1a2b3c4d,req_b-99887766 prefill=5 decode=1 waiting=3 kv_used=4 "
                                 "kv_total=64 preempted=0")
        assert steps[1].endswith("reqs=req_b-99887766 prefill=0 decode=1 waiting=3 kv_used=4 kv_total=64 preempted=0")
        assert got.count("FE Sampling") == 2 and got.count("OTHER schedule") == 2
        assert inst.info()["status"] == "patched" and inst.info()["version"] == "0.11.0"
    finally:
        inst.uninstrument()
    from vllm.v1.engine.core import EngineCore

    assert not hasattr(EngineCore.__dict__["step"], "_self_teller")  # originals restored


def test_vllm_worker_thread_opens_its_own_step_and_comm(fake_engine):
    fake_engine(VLLM_FILES, "0.11.0")
    inst = VLLMInstrumentor()
    inst.instrument(runtime)
    try:
        from vllm.distributed.parallel_state import GroupCoordinator
        from vllm.v1.core.sched.scheduler import SchedulerOutput
        from vllm.v1.worker.gpu_worker import Worker

        tp = GroupCoordinator("tp:0", world_size=2)

        def worker_loop():
            w = Worker()
            w.execute_model(SchedulerOutput({"r1-00000000": 3}))
            tp.all_reduce([1, 2])
            w.sample_tokens(None)

        t = threading.Thread(target=worker_loop)
        t.start()
        t.join()
        cols = ranges.RECORDER.drain()
        rows = sorted(zip(cols["start_ns"].tolist(), cols["end_ns"].tolist(), cols["name"].to_pylist(), strict=True))
        step = next(r for r in rows if r[2].startswith("STEP"))
        assert step[2].endswith("reqs=r1-00000000")
        comm = next(r for r in rows if r[2].startswith("COMM"))
        assert comm[2] == "COMM all_reduce bytes=0 group=tp:0 seq=0"
        sampling = next(r for r in rows if r[2] == "FE Sampling")
        assert step[0] <= comm[0] <= comm[1] <= step[1] and sampling[1] <= step[1]  # STEP spans sampling too
    finally:
        inst.uninstrument()


def test_version_mismatch_is_a_logged_no_op(fake_engine, capsys):
    fake_engine(VLLM_FILES, "0.3.1")
    inst = VLLMInstrumentor()
    inst.instrument(runtime)
    try:
        from vllm.v1.engine.core import EngineCore

        core = EngineCore([{"x": 1}])
        core.step()
        assert names() == []
        assert inst.status == "version-mismatch" and "0.3.1" in inst.reason
        assert not hasattr(EngineCore.__dict__["step"], "_self_teller")
        err = capsys.readouterr().err
        assert err.count("[teller] vllm: vllm 0.3.1 is not supported") == 1
    finally:
        inst.uninstrument()


def test_sglang_run_batch_is_a_step(fake_engine):
    fake_engine(SGLANG_FILES, "0.5.2")
    inst = SGLangInstrumentor()
    inst.instrument(runtime)
    try:
        from sglang.srt.managers.scheduler import ScheduleBatch, Scheduler

        assert Scheduler().run_batch(ScheduleBatch(["rid-1", "rid-2"], extend=True)) == 2
        assert Scheduler().run_batch(batch=ScheduleBatch(["rid-3"])) == 1
        got = names()
        assert [n.split(" reqs=")[1] for n in got] == [
            "rid-1,rid-2 prefill=14 decode=0 waiting=1 kv_used=28 kv_total=128",
            "rid-3 prefill=0 decode=1 waiting=1 kv_used=28 kv_total=128"]
    finally:
        inst.uninstrument()


def test_missing_hook_point_is_logged_and_skipped(fake_engine, capsys):
    files = dict(SGLANG_FILES)
    files["sglang/srt/managers/scheduler.py"] = "class Scheduler:\n    pass\n"
    fake_engine(files, "0.5.2")
    inst = SGLangInstrumentor()
    inst.instrument(runtime)
    try:
        import sglang.srt.managers.scheduler  # noqa: F401

        assert inst.missing == ["sglang.srt.managers.scheduler:Scheduler.run_batch"]
        assert "hook point sglang.srt.managers.scheduler:Scheduler.run_batch not found" in capsys.readouterr().err
    finally:
        inst.uninstrument()


@contextlib.contextmanager
def generic_engine(tmp_path: Path, module: str, source: str, hooks: str):
    """``module`` (``source``) importable from ``tmp_path``, instrumented by the hooks file
    ``hooks``; yields the imported module, then uninstruments and forgets it."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    (tmp_path / "h.toml").write_text(textwrap.dedent(hooks))
    sys.path.insert(0, str(tmp_path))
    ranges.RECORDER.drain(final=True)
    inst = GenericInstrumentor.from_file(tmp_path / "h.toml")
    inst.instrument(runtime)
    try:
        yield importlib.import_module(module)
    finally:
        inst.uninstrument()
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)


def test_generic_hooks_on_a_small_module(tmp_path: Path):
    src = """
        class Batch:
            def __init__(self, rids):
                self.reqs = [type("R", (), {"rid": r})() for r in rids]
        class Engine:
            stats = {"decode": 2, "prefill": 5, "bogus": 1, "waiting": "x"}
            def step(self, batch, scale=1):
                return self.layer(len(batch.reqs)) * scale
            def layer(self, n):
                return n + 1
        def helper(x):
            return x * 2
    """
    hooks = """
        [hooks]
        "tinyeng:Engine.step" = "step"
        "tinyeng:Engine.layer" = "FE"
        "tinyeng:helper" = "BE"
        [requests]
        "tinyeng:Engine.step" = "args[0].reqs[*].rid"
        "tinyeng:helper" = "args[0]"
        [batch]
        "tinyeng:Engine.step" = "self.stats"
    """
    with generic_engine(tmp_path, "tinyeng", src, hooks) as tinyeng:
        assert tinyeng.Engine().step(tinyeng.Batch(["q1", "q2"]), scale=3) == 9
        assert tinyeng.helper(21) == 42
        got = names()
        assert got[0] == "FE Engine.layer" and got[1].startswith("STEP id=") and got[1].endswith(" reqs=q1,q2 prefill=5 decode=2")
        assert got[2] == "BE helper reqs=21"
    assert tinyeng.helper(1) == 2 and names() == []


def test_generic_models_table_puts_fe_ranges_on_the_served_model(tmp_path: Path):
    """[models]: the model a hooked method reaches gets FE ranges on its layers, attention and MLP
    blocks (once, however often the method is called); other submodules stay unrecorded."""
    src = """
        import torch
        from torch import nn

        class TinyAttention(nn.Module):
            def forward(self, x):
                return x * 2
        class TinyMLP(nn.Module):
            def forward(self, x):
                return x + 1
        class TinyDecoderLayer(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn, self.mlp, self.scale = TinyAttention(), TinyMLP(), nn.Identity()
            def forward(self, x):
                return self.scale(self.mlp(self.attn(x)))
        class Engine:
            def __init__(self):
                self.model = nn.Sequential(TinyDecoderLayer(), TinyDecoderLayer())
            def add(self, rid):
                return rid
            def step(self, x):
                return self.model(x)
    """
    hooks = """
        "tinymod:Engine.step" = "STEP"
        "tinymod:Engine.add" = "OTHER"
        [models]
        "tinymod:Engine.add" = "self.model"
    """
    import torch

    with generic_engine(tmp_path, "tinymod", src, hooks) as tinymod:
        eng = tinymod.Engine()
        assert eng.step(torch.ones(1)).item() == 7.0  # before any add: no FE hooks yet
        assert [n.split(" id=")[0] for n in names() if n.startswith(("FE", "STEP"))] == ["STEP"]
        eng.add("a")
        eng.add("b")
        assert eng.step(torch.ones(1)).item() == 7.0
        got = [n for n in names() if n.startswith("FE")]
        assert got == ["FE TinyAttention", "FE TinyMLP", "FE TinyDecoderLayer"] * 2, got
    eng.step(torch.ones(1))
    assert not [n for n in names() if n.startswith(("FE", "STEP"))]  # the FE hooks left with the instrumentor


def test_request_paths_are_walked_not_evaluated():
    class Obj:
        d = {"a": 1, "b": 2}
        lst = [{"rid": "x"}, {"rid": "y"}]

    assert RequestPath.parse("self.d").ids(Obj(), (), {}) == ["a", "b"]
    assert RequestPath.parse("args[0].lst[*]['rid']").ids(None, (Obj(),), {}) == ["x", "y"]
    assert RequestPath.parse('kwargs["k"][-1]').ids(None, (), {"k": [1, 2, 3]}) == ["3"]
    for bad in ("__import__('os')", "args[0].__class__", "args[0] + 1", "x.y"):
        with pytest.raises(ValueError):
            RequestPath.parse(bad)


def test_bad_hooks_files_name_the_entry(tmp_path: Path):
    cases = {
        '"nocolon" = "STEP"\n': "not of the form",
        '"m:C.f" = "LAYER"\n': "tag 'LAYER'",
        '"m:C.f" = "FE"\n[requests]\n"m:C.g" = "args[0]"\n': "not hooked",
        '"m:C.f" = "STEP"\n[requests]\n"m:C.f" = "args[0].__dict__"\n': "dunder",
        '"m:C.f" = "FE"\n[batch]\n"m:C.f" = "self.stats"\n': "not a STEP hook",
        '"m:C.f" = "FE"\n[models]\n"m:C.g" = "self.model"\n': "not hooked",
        '"m:C.f" = \n': "not valid TOML",
        "": "no hooks",
    }
    for text, msg in cases.items():
        p = tmp_path / "h.toml"
        p.write_text(text)
        with pytest.raises(InputError, match=msg):
            load_hooks(p)
    with pytest.raises(InputError, match="not found"):
        load_hooks(tmp_path / "missing.toml")
    assert load_hooks(Path(__file__).parents[1] / "examples" / "hooks_example.toml").hooks


def test_transformers_instrumentor_wraps_and_restores():
    pytest.importorskip("transformers")
    from transformers.generation.continuous_batching import continuous_api, model_runner

    from teller.record.instrument.transformers_cb import TransformersCBInstrumentor

    original = continuous_api.ContinuousBatchProcessor.__dict__["prepare_next_batch"]
    inst = TransformersCBInstrumentor()
    inst.instrument(runtime)
    try:
        assert inst.status == "patched" and not inst.missing
        assert getattr(continuous_api.ContinuousBatchProcessor.__dict__["prepare_next_batch"], "_self_teller", False)
        assert getattr(model_runner.ModelRunner.__dict__["_sample"], "_self_teller", False)
    finally:
        inst.uninstrument()
    assert continuous_api.ContinuousBatchProcessor.__dict__["prepare_next_batch"] is original
