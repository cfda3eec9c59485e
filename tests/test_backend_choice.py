"""backend="auto" on a GPU times its candidates once per kind of call and runs the fastest
(kernels.backend_choice). Checked on the CPU with fake timers: a chooser that times on the CPU, with
SDPA and the eager reference as candidates, decides exactly as the timings say."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import alibi_attention, backend_choice
from kernels.attention import eager_alibi_attention, sdpa_alibi_attention

GRID, PREFIX = (3, 4), 5


def make_qkv(batch=2, heads=3, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, PREFIX + GRID[0] * GRID[1], dim, generator=gen) for _ in range(3)]


class FakeTimer:
    """Reports given times per backend, after running the candidate once (so its call is exercised)."""

    def __init__(self, times, fail=()):
        self.times, self.fail, self.calls = dict(times), set(fail), []

    def __call__(self, name, run):
        self.calls.append(name)
        if name in self.fail:
            raise RuntimeError("CUDA out of memory. Tried to allocate 9.00 GiB")
        run()
        return self.times[name]


def cpu_chooser(timer, free=2**40, **kwargs):
    return backend_choice.BackendChooser(candidates=("sdpa", "eager"), devices=("cpu",), timer=timer,
                                         free_memory=lambda device: free, **kwargs)


def test_the_faster_candidate_runs_and_the_choice_is_kept():
    q, k, v = make_qkv()
    timer = FakeTimer({"sdpa": 2.0, "eager": 1.0})
    with backend_choice.use_chooser(cpu_chooser(timer)) as chooser:
        out = alibi_attention(q, k, v, GRID, PREFIX)
        assert timer.calls == ["sdpa", "eager"]
        eager = eager_alibi_attention(q, k, v, GRID, PREFIX, None, True, True)
        assert torch.equal(out, eager)
        assert not torch.equal(eager, sdpa_alibi_attention(q, k, v, GRID, PREFIX, None, True, True))  # tellable apart
        alibi_attention(q, k, v, GRID, PREFIX)
        assert timer.calls == ["sdpa", "eager"]  # the same kind of call: not timed again
        text = chooser.explain()
    assert "constant slopes fwd: eager (timed) | timed sdpa 2.000 ms, eager 1.000 ms" in text


def test_swapped_times_pick_sdpa():
    q, k, v = make_qkv()
    timer = FakeTimer({"sdpa": 1.0, "eager": 3.0})
    with backend_choice.use_chooser(cpu_chooser(timer)):
        out = alibi_attention(q, k, v, GRID, PREFIX)
    assert torch.equal(out, sdpa_alibi_attention(q, k, v, GRID, PREFIX, None, True, True))


def test_each_kind_of_call_is_timed_apart_and_timing_leaves_the_callers_tensors_alone():
    q, k, v = make_qkv()
    slopes = torch.tensor([0.5, 1.0, 2.0])
    timer = FakeTimer({"sdpa": 1.0, "eager": 2.0})
    with backend_choice.use_chooser(cpu_chooser(timer)) as chooser:
        alibi_attention(q, k, v, GRID, PREFIX)
        alibi_attention(q, k, v, GRID, PREFIX, slopes)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        learned = slopes.clone().requires_grad_()
        out = alibi_attention(*leaves, GRID, PREFIX, learned)
        # The timing ran forward and backward on copies: nothing reached the caller's leaves yet.
        assert all(t.grad is None for t in (*leaves, learned))
        out.sum().backward()
        assert learned.grad is not None and torch.isfinite(learned.grad).all()
        kinds = [(kind.slopes, kind.backward) for kind in chooser.choices]
    assert kinds == [("constant", False), ("per-head", False), ("learned", True)]
    assert timer.calls == ["sdpa", "eager"] * 3


def test_the_timed_backward_really_runs_a_backward(monkeypatch):
    q, k, v = make_qkv()
    seen = []

    def timer(name, run):
        real = torch.Tensor.backward
        monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **kw: seen.append(name) or real(self, *a, **kw))
        run()
        monkeypatch.setattr(torch.Tensor, "backward", real)
        return {"sdpa": 1.0, "eager": 2.0}[name]

    with backend_choice.use_chooser(cpu_chooser(timer)):
        alibi_attention(q.requires_grad_(), k, v, GRID, PREFIX)
        assert seen == ["sdpa", "eager"]
        with torch.no_grad():  # no graph: a forward-only kind, timed without backward
            alibi_attention(q, k, v, GRID, PREFIX)
    assert seen == ["sdpa", "eager"]


def test_a_mask_over_the_cap_is_never_timed():
    q, k, v = make_qkv(heads=3)
    n = q.shape[2]
    per_head_mask = 3 * n * n * 4
    # Free memory such that 5 % of it is just below the per-head mask but above the 2-D one.
    free = int((per_head_mask - 1) / backend_choice.MASK_CAP_FREE_FRACTION)
    timer = FakeTimer({"sdpa": 1.0, "eager": 2.0})
    with backend_choice.use_chooser(cpu_chooser(timer, free=free)) as chooser:
        alibi_attention(q, k, v, GRID, PREFIX)  # constant slopes: an (N, N) mask fits
        out = alibi_attention(q, k, v, GRID, PREFIX, torch.tensor([0.5, 1.0, 2.0]))
        choices = list(chooser.choices.values())
    assert timer.calls == ["sdpa", "eager"]  # the per-head call timed nothing: one candidate was left
    assert choices[0].backend == "sdpa" and choices[1].backend == "eager"
    assert choices[1].how == "only candidate"
    assert f"its mask takes {per_head_mask / 2**20:.1f} MiB" in choices[1].excluded["sdpa"]
    assert torch.equal(out, eager_alibi_attention(q, k, v, GRID, PREFIX, torch.tensor([0.5, 1.0, 2.0]), True, True))


def test_the_fixed_cap_applies_whatever_memory_is_free():
    kind = backend_choice.CallKind(torch.device("cpu"), torch.bfloat16, (1, 12, 5334, 64), (73, 73), 5, True, True,
                                   "euclidean", "per-head", False)
    assert backend_choice.mask_bytes(kind) == 12 * 5334 * 5334 * 2  # 651 MiB: over 64 MiB
    timer = FakeTimer({"sdpa": 1.0, "eager": 2.0})
    chooser = cpu_chooser(timer, free=2**50)
    assert chooser.choose(kind, "sdpa", lambda: {"sdpa": None, "eager": None}, torch.device("cpu")) == "eager"
    assert "over the cap of 64.0 MiB" in chooser.choices[kind].excluded["sdpa"]
    assert timer.calls == []


def test_a_candidate_that_fails_while_timed_is_excluded_with_its_reason():
    q, k, v = make_qkv()
    timer = FakeTimer({"sdpa": 1.0, "eager": 2.0}, fail={"sdpa"})
    with backend_choice.use_chooser(cpu_chooser(timer)) as chooser:
        alibi_attention(q, k, v, GRID, PREFIX)
        (choice,) = chooser.choices.values()
    assert choice.backend == "eager" and choice.times_ms == {"eager": 2.0}
    assert choice.excluded["sdpa"].startswith("failed while timed: RuntimeError: CUDA out of memory")


def test_every_candidate_failing_falls_back_to_the_rule():
    q, k, v = make_qkv()
    timer = FakeTimer({}, fail={"sdpa", "eager"})
    with backend_choice.use_chooser(cpu_chooser(timer)) as chooser:
        out = alibi_attention(q, k, v, GRID, PREFIX)
        (choice,) = chooser.choices.values()
    assert (choice.backend, choice.how, choice.reason) == ("sdpa", "fallback", "every candidate failed while timed")
    assert torch.equal(out, sdpa_alibi_attention(q, k, v, GRID, PREFIX, None, True, True))
    with backend_choice.use_chooser(chooser):
        alibi_attention(q, k, v, GRID, PREFIX)
    assert timer.calls == ["sdpa", "eager"]  # the fallback is kept: failing candidates are not timed on every call


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_deterministic_mode_keeps_the_rule(deterministic):
    q, k, v = make_qkv()
    timer = FakeTimer({"sdpa": 2.0, "eager": 1.0})
    with backend_choice.use_chooser(cpu_chooser(timer)) as chooser:
        alibi_attention(q, k, v, GRID, PREFIX)
        (choice,) = chooser.choices.values()
    assert timer.calls == []
    assert (choice.backend, choice.how, choice.reason) == ("sdpa", "rule", "deterministic mode")


def test_deterministic_mode_overrides_a_timed_choice_while_it_lasts():
    q, k, v = make_qkv()
    timer = FakeTimer({"sdpa": 2.0, "eager": 1.0})
    eager = eager_alibi_attention(q, k, v, GRID, PREFIX, None, True, True)
    with backend_choice.use_chooser(cpu_chooser(timer)):
        assert torch.equal(alibi_attention(q, k, v, GRID, PREFIX), eager)
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            out = alibi_attention(q, k, v, GRID, PREFIX)
        finally:
            torch.use_deterministic_algorithms(before)
        assert torch.equal(out, sdpa_alibi_attention(q, k, v, GRID, PREFIX, None, True, True))
        assert torch.equal(alibi_attention(q, k, v, GRID, PREFIX), eager)
    assert timer.calls == ["sdpa", "eager"]


def test_devices_without_timing_follow_the_rule_and_say_so():
    q, k, v = make_qkv()
    timer = FakeTimer({"sdpa": 2.0, "eager": 1.0})
    chooser = backend_choice.BackendChooser(candidates=("sdpa", "eager"), devices=("cuda",), timer=timer)
    with backend_choice.use_chooser(chooser):
        alibi_attention(q, k, v, GRID, PREFIX)
        assert "sdpa (rule: no timing on cpu)" in kernels.explain()
    assert timer.calls == []


def test_timing_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ALIBI_VIT_ATTENTION_TIMING", "0")
    timer = FakeTimer({"sdpa": 2.0, "eager": 1.0})
    chooser = cpu_chooser(timer)
    q, k, v = make_qkv()
    with backend_choice.use_chooser(chooser):
        alibi_attention(q, k, v, GRID, PREFIX)
    assert timer.calls == [] and "ALIBI_VIT_ATTENTION_TIMING=0" in chooser.explain()


def test_the_choice_file_spares_later_processes_the_timing(tmp_path):
    path = tmp_path / "choices.json"
    q, k, v = make_qkv()
    first = FakeTimer({"sdpa": 2.0, "eager": 1.0})
    with backend_choice.use_chooser(cpu_chooser(first, choice_file=path)):
        alibi_attention(q, k, v, GRID, PREFIX)
    saved = json.loads(path.read_text())
    (entry,) = saved.values()
    assert entry["backend"] == "eager" and entry["times_ms"] == {"sdpa": 2.0, "eager": 1.0}

    later = FakeTimer({"sdpa": 1.0, "eager": 5.0})  # would pick sdpa if it timed
    with backend_choice.use_chooser(cpu_chooser(later, choice_file=path)) as chooser:
        out = alibi_attention(q, k, v, GRID, PREFIX)
        (choice,) = chooser.choices.values()
    assert later.calls == [] and (choice.backend, choice.how) == ("eager", "file")
    assert torch.equal(out, eager_alibi_attention(q, k, v, GRID, PREFIX, None, True, True))


def test_an_unreadable_choice_file_is_reported_and_rewritten(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{ not json")
    timer = FakeTimer({"sdpa": 2.0, "eager": 1.0})
    with pytest.warns(UserWarning, match=f"cannot read {path}"):
        chooser = cpu_chooser(timer, choice_file=path)
    q, k, v = make_qkv()
    with backend_choice.use_chooser(chooser):
        alibi_attention(q, k, v, GRID, PREFIX)
    assert timer.calls == ["sdpa", "eager"]
    assert [e["backend"] for e in json.loads(path.read_text()).values()] == ["eager"]


def test_the_wall_timer_takes_the_median_after_one_untimed_call():
    calls = []
    ms = backend_choice.wall_timer("sdpa", lambda: calls.append(1), repeats=4)
    assert len(calls) == 5 and 0 <= ms < 50


def test_per_head_slopes_reach_sdpa_as_a_4d_mask(monkeypatch):
    """torch's cuDNN attention takes 2-D or 4-D masks only: a 3-D per-head mask would never reach it."""
    q, k, v = make_qkv()
    masks = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, **kw: masks.append(attn_mask) or real(*a, attn_mask=attn_mask, **kw))
    slopes = torch.tensor([0.5, 1.0, 2.0])
    out = alibi_attention(q, k, v, GRID, PREFIX, slopes, backend="sdpa")
    alibi_attention(q, k, v, GRID, PREFIX, backend="sdpa")
    n = q.shape[2]
    assert [tuple(m.shape) for m in masks] == [(1, 3, n, n), (n, n)]
    ref = eager_alibi_attention(q.double(), k.double(), v.double(), GRID, PREFIX, slopes.double(), True, True)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_the_label_names_what_a_user_would_look_for():
    kind = backend_choice.CallKind(torch.device("cuda", 0), torch.bfloat16, (48, 12, 1374, 64), (37, 37), 5, True, True,
                                   "euclidean", "learned", True)
    assert kind.label() == "cuda:0 bfloat16 B=48 H=12 N=1374 d=64 grid=37x37 prefix=5 learned slopes fwd+bwd"
    key = json.loads(kind.file_key("NVIDIA H200", "torch 2.11, triton 3.6"))
    assert key[:3] == ["torch 2.11, triton 3.6", "NVIDIA H200", "bfloat16"] and "cuda:0" not in key
    assert math.isclose(backend_choice.mask_bytes(kind) / 2**20, 12 * 1374 * 1374 * 2 / 2**20)
