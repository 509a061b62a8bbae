"""Framework hooks: FE module ranges, BE aten-op ranges (TorchDispatchMode), COMM ranges."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from teller.record import ranges, runtime  # noqa: E402
from teller.record.instrument import torch_ops  # noqa: E402


@pytest.fixture(autouse=True)
def clean_recorder():
    ranges.RECORDER.drain(final=True)
    yield
    ranges.RECORDER.drain(final=True)


def recorded() -> list[tuple[int, int, str]]:
    cols = ranges.RECORDER.drain()
    if cols is None:
        return []
    return sorted(zip(cols["start_ns"].tolist(), cols["end_ns"].tolist(), cols["name"].to_pylist(), strict=True))


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.softmax(self.q(x), -1)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.silu(self.up(x))


class ToyDecoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        return x + self.mlp(self.self_attn(x))


class ToyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([ToyDecoderLayer(), ToyDecoderLayer()])
        self.lm_head = torch.nn.Linear(8, 16)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def test_fe_hooks_follow_the_module_tree_and_come_off():
    torch.manual_seed(0)
    m = ToyLM().eval()
    ids = torch.tensor([[1, 2, 3]])
    ref = m(ids)
    assert torch_ops.attach_module_ranges(runtime, m) == 8  # embedding, 2 × (layer, attention, mlp), lm head
    assert torch_ops.attach_module_ranges(runtime, m) == 0  # once per model
    out = m(ids)
    assert torch.equal(out, ref)
    got = recorded()
    assert [n for _, _, n in got] == ["FE Embedding", "FE ToyDecoderLayer", "FE Attention", "FE MLP",
                                      "FE ToyDecoderLayer", "FE Attention", "FE MLP", "FE LMHead"]
    layer, attn = got[1], got[2]
    assert layer[0] <= attn[0] <= attn[1] <= layer[1]
    torch_ops.detach_module_ranges(m)
    m(ids)
    assert recorded() == []


def test_fe_range_closes_when_forward_raises():
    m = ToyLM()
    torch_ops.attach_module_ranges(runtime, m)
    try:
        with pytest.raises(IndexError):
            m(torch.tensor([[99]]))  # out of the embedding's range
        assert ranges.RECORDER.depth() == 0
        assert [n for _, _, n in recorded()] == ["FE Embedding"]
    finally:
        torch_ops.detach_module_ranges(m)


@pytest.mark.parametrize("depth", [1, 2])
def test_be_ranges_record_aten_ops_without_changing_results(depth):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.inference_mode():
        ref = torch.softmax(lin(x), -1)
        torch_ops.be_enter(runtime, depth)
        try:
            out = torch.softmax(lin(x), -1)
        finally:
            torch_ops.be_exit()
        after = torch.softmax(lin(x), -1)  # mode gone: nothing more recorded
    assert torch.equal(out, ref) and torch.equal(after, ref)
    got = recorded()
    top = [n for s, e, n in got if not any(s2 < s and e <= e2 for s2, e2, _ in got)]
    assert top == ["BE aten::linear", "BE aten::softmax"]
    children = [n for s, e, n in got if n not in top]
    if depth == 1:
        assert children == []
    else:  # linear and softmax are CompositeImplicit: their parts become children
        assert "BE aten::addmm" in children or "BE aten::mm" in children
        assert "BE aten::_softmax" in children
        lin_s, lin_e = next((s, e) for s, e, n in got if n == "BE aten::linear")
        assert all(lin_s <= s and e <= lin_e for s, e, n in got if n in ("BE aten::addmm", "BE aten::t"))


def test_be_depth_zero_and_steps_on_threads():
    def work(out):
        runtime.push_step("STEP id=99 reqs=t")
        torch.ones(2) + 1
        runtime.pop_step()
        out.append(threading.get_native_id())

    tids: list[int] = []
    old = runtime._default_be_depth
    t = threading.Thread(target=work, args=(tids,))
    t.start()
    t.join()
    got = recorded()
    assert got[0][2] == "STEP id=99 reqs=t" and any(n == "BE aten::add" for _, _, n in got)
    try:
        runtime._default_be_depth = lambda: 0
        work(tids)
        assert [n for _, _, n in recorded()] == ["STEP id=99 reqs=t"]
    finally:
        runtime._default_be_depth = old


def test_comm_ranges_for_torch_distributed(tmp_path: Path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    inst = torch_ops.TorchDistributedInstrumentor()
    inst.instrument(runtime)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        t = torch.ones(1024, dtype=torch.float32)
        dist.all_reduce(t)
        dist.all_reduce(t, group=None)
        out = torch.empty(1024)
        dist.all_gather_into_tensor(out, t)
        dist.broadcast(t, src=0)
        sub = dist.new_group([0], group_desc="tp")
        dist.all_reduce(t, group=sub)
        with torch_ops.comm_range(runtime, "all_reduce", 8, "outer"):
            dist.all_reduce(t)  # nested: recorded once, by the outer range
        got = [n for _, _, n in recorded()]
        assert got[:4] == ["COMM all_reduce bytes=4096 group=default seq=0",
                           "COMM all_reduce bytes=4096 group=default seq=1",
                           "COMM all_gather_into_tensor bytes=4096 group=default seq=2",
                           "COMM broadcast bytes=4096 group=default seq=3"]
        assert got[4].startswith("COMM all_reduce bytes=4096 group=") and got[4].endswith("seq=0")
        assert "default" not in got[4]
        assert got[5] == "COMM all_reduce bytes=8 group=outer seq=0" and len(got) == 6
        assert torch.equal(t, torch.ones(1024))
    finally:
        dist.destroy_process_group()
        inst.uninstrument()
    assert not hasattr(dist.all_reduce, "_self_teller")
