"""What ``backend="auto"`` runs: a rule where timing cannot help, the fastest candidate where it can.

On a CUDA device the fastest ALiBi attention depends on the size, the slope kind and the pass: on an
H100/H200 with one slope for all heads, SDPA with a materialised ``(N, N)`` bias runs on cuDNN and
beats the fused kernel at 518 and 1022 px, while the fused kernel wins at 224 and 2072 px and with
per-head or learned slopes. No fixed rule is right everywhere, so, as ``torch.backends.cudnn.benchmark``
does for convolutions, the first call of each kind times the candidates once and every later call of
that kind runs the winner.

A call's kind (:class:`CallKind`) is its device, dtype, shape, grid, prefix, bias options, slope kind
(``constant``: ``slopes=None``; ``per-head``: fixed slopes; ``learned``: slopes that require grad) and
pass (forward, or forward+backward when autograd records the call). The candidates:

- ``"triton"``, the fused kernel, where it supports the head_dim and dtype (:func:`kernels.attention.auto_backend`);
- ``"sdpa"``, SDPA with the materialised bias, only while the mask a call builds (``N²`` elements, times
  the heads with per-head or learned slopes) fits ``MASK_CAP_BYTES`` (64 MiB) and ``MASK_CAP_FREE_FRACTION``
  (5 %) of the device's free memory. A larger mask is never timed: its memory, not its speed, rules it out.

Flex is not a candidate: it compiles per shape, which takes seconds to minutes, longer than the time it
could save. A candidate that fails while being timed (out of memory, a compile error) is excluded with
the reason. Each candidate runs once untimed (compiles, autotunes), then ``REPEATS`` timed calls on
copies of the inputs; the median decides.

The rule (:func:`kernels.attention.auto_backend`: the fused kernel on CUDA where supported, SDPA
elsewhere) stays in force on the CPU, under Triton's interpreter, in deterministic mode
(``torch.use_deterministic_algorithms``: a timed choice could differ between runs), while
``torch.compile`` traces a model or a CUDA graph is captured (nothing may be timed then), and when
``ALIBI_VIT_ATTENTION_TIMING=0``. A choice timed before a capture is used inside it.

Choices live in memory for the process. ``ALIBI_VIT_ATTENTION_CHOICES=/path/choices.json`` (or
:func:`use_choice_file`) also keeps them on disk, keyed by device name and torch and Triton versions, so
later processes skip the timing; an unreadable file is reported once and ignored. :func:`explain` says
what ``auto`` chose for every kind of call so far, and why; each new choice is also logged at INFO on
the ``kernels.backend_choice`` logger. Processes of one DDP job time independently and may choose
differently; each choice computes the same attention to within rounding.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

__all__ = ["CallKind", "Choice", "BackendChooser", "MASK_CAP_BYTES", "MASK_CAP_FREE_FRACTION", "REPEATS",
           "chooser", "explain", "use_chooser", "use_choice_file"]

log = logging.getLogger(__name__)

MASK_CAP_BYTES = 64 * 2**20
MASK_CAP_FREE_FRACTION = 0.05
REPEATS = 5
CANDIDATES = ("triton", "sdpa")
TIMED_DEVICES = ("cuda",)


class CallKind(NamedTuple):
    """What a choice is valid for: calls that agree on all of these run the same backend. (A tuple:
    one is built for every call, and a dataclass costs several times as much to build.)"""

    device: torch.device
    dtype: torch.dtype  # the dtype the call runs in (the autocast dtype under autocast)
    shape: tuple  # (batch, heads, N, head_dim)
    grid: tuple  # (h, w)
    prefix: int
    wrap: bool
    normalize: bool
    metric: str
    slopes: str  # "constant", "per-head" or "learned"
    backward: bool  # autograd records the call: forward and backward are timed together

    def label(self) -> str:
        b, h, n, d = self.shape
        return (f"{self.device} {str(self.dtype).removeprefix('torch.')} B={b} H={h} N={n} d={d} grid={self.grid[0]}x{self.grid[1]} "
                f"prefix={self.prefix} {self.slopes} slopes {'fwd+bwd' if self.backward else 'fwd'}"
                f"{'' if self.metric == 'euclidean' else ' ' + self.metric}"
                f"{'' if self.wrap else ' no-wrap'}{'' if self.normalize else ' unnormalised'}")

    def file_key(self, device_name: str, versions: str) -> str:
        """The choice file's key: the device by name (a choice holds for any H200, not for cuda:0)."""
        return json.dumps([versions, device_name, str(self.dtype).removeprefix("torch."), *list(self)[2:]])


@dataclass
class Choice:
    """The backend ``auto`` runs for one kind of call, and why."""

    backend: str
    # "rule" (timing not allowed now), "timed", "file" (a timed choice read from the choice file), "only candidate"
    # or "fallback" (the rule's backend: no candidate could be timed)
    how: str
    reason: str = ""
    times_ms: dict[str, float] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"{self.backend} ({self.how}{': ' + self.reason if self.reason else ''})"]
        if self.times_ms:
            parts.append("timed " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.times_ms.items()))
        if self.excluded:
            parts.append("not timed: " + "; ".join(f"{name}: {why}" for name, why in self.excluded.items()))
        return " | ".join(parts)


def mask_bytes(kind: CallKind) -> int:
    """Bytes of the additive mask the sdpa backend builds for one call of this kind."""
    _, heads, n, _ = kind.shape
    itemsize = torch.empty((), dtype=kind.dtype).element_size()
    return n * n * itemsize * (1 if kind.slopes == "constant" else heads)


def cuda_timer(name: str, run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median milliseconds of ``repeats`` calls of ``run`` after one untimed call, by CUDA events."""
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_timer(name: str, run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median milliseconds of ``repeats`` calls of ``run`` after one untimed call, by the wall clock."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def device_free_memory(device: torch.device) -> int:
    """Free bytes on ``device``: the CUDA driver's figure, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # a platform without these counters: no cap but the fixed one
        return 2**63


class BackendChooser:
    """Chooses and remembers the backend of each kind of call.

    Args:
        candidates: backends timed against each other, in order of preference on a tie.
        devices: device types on which candidates are timed; elsewhere the rule decides.
        timer: ``timer(backend, run) -> ms``; the default times CUDA calls by events, others by the wall clock.
        free_memory: ``free_memory(device) -> bytes``, for the mask cap (default: :func:`device_free_memory`).
        choice_file: a JSON file that keeps timed choices across processes, or None.
    """

    def __init__(self, candidates=CANDIDATES, devices=TIMED_DEVICES, timer=None, free_memory=None, choice_file=None):
        self.candidates = tuple(candidates)
        self.devices = tuple(devices)
        # Read once: both are process settings (Triton reads TRITON_INTERPRET on import, too).
        self.timing_off = os.environ.get("ALIBI_VIT_ATTENTION_TIMING") == "0"
        self.interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        self.timer = timer
        self.free_memory = free_memory or device_free_memory
        self.choices: dict[CallKind, Choice] = {}
        self._lock = threading.Lock()
        self._file: Path | None = None
        self._file_choices: dict[str, dict] = {}
        if choice_file:
            self.use_file(choice_file)

    # -- the choice file -------------------------------------------------------------------------
    def use_file(self, path) -> None:
        """Keep timed choices in ``path`` (JSON); choices already there are used from now on."""
        self._file = Path(path).expanduser()
        self._file_choices = {}
        if not self._file.exists():
            return
        try:
            data = json.loads(self._file.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            self._file_choices = {k: v for k, v in data.items() if isinstance(v, dict) and "backend" in v}
        except (OSError, ValueError) as err:
            warnings.warn(f"attention backend choices: cannot read {self._file} ({err}); timing again and "
                          "rewriting it", stacklevel=2)

    def _save(self, key: str, choice: Choice) -> None:
        if self._file is None:
            return
        self._file_choices[key] = {"backend": choice.backend, "times_ms": choice.times_ms, "excluded": choice.excluded}
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            partial = self._file.with_name(f".{self._file.name}.{os.getpid()}.partial")
            partial.write_text(json.dumps(self._file_choices, indent=1) + "\n")
            os.replace(partial, self._file)
        except OSError as err:
            warnings.warn(f"attention backend choices: cannot write {self._file} ({err}); keeping them in memory "
                          "only", stacklevel=3)
            self._file = None

    # -- choosing --------------------------------------------------------------------------------
    def rule_only(self, device_type: str) -> str:
        """Why calls on ``device_type`` must follow the rule now (whatever was timed before), or ""."""
        if device_type not in self.devices:
            return f"no timing on {device_type}"
        if self.timing_off:
            return "ALIBI_VIT_ATTENTION_TIMING=0"
        if self.interpreted and device_type == "cuda":  # the fused kernel would run on the CPU: no use timing it
            return "Triton's interpreter"
        if torch.are_deterministic_algorithms_enabled():
            return "deterministic mode"
        return ""

    def choose(self, kind: CallKind, rule: str, make_runners: Callable[[], dict[str, Callable[[], object]]],
               device: torch.device) -> str:
        """The backend for a call of ``kind``: remembered, read from the choice file, or timed now.

        ``rule`` is the rule's answer; ``make_runners()`` maps each backend to a function running one
        call of this kind (forward, or forward+backward) on copies of the inputs.
        """
        device_type = device.type
        known = self.choices.get(kind)
        why = self.rule_only(device_type)
        if why:
            if known is None:  # a timed choice stays for when timing is allowed again
                self.choices[kind] = Choice(rule, "rule", why)
            return rule
        if known is not None and known.how != "rule":
            return known.backend
        if device_type == "cuda" and torch.cuda.is_current_stream_capturing():
            return rule  # nothing may run while a graph is captured; a later call outside it is timed
        with self._lock:
            known = self.choices.get(kind)
            if known is None or known.how == "rule":
                known = self._decide(kind, rule, make_runners(), device)
                self.choices[kind] = known
                log.info("attention backend for %s: %s", kind.label(), known.describe())
        return known.backend

    def _decide(self, kind, rule, runners, device) -> Choice:
        device_type = device.type
        device_name = torch.cuda.get_device_name(device) if device_type == "cuda" else device_type
        key = kind.file_key(device_name, _versions())
        saved = self._file_choices.get(key)
        if saved is not None and saved["backend"] in runners:
            return Choice(saved["backend"], "file", str(self._file), dict(saved.get("times_ms", {})),
                          dict(saved.get("excluded", {})))
        excluded = {}
        names = []
        for name in self.candidates:
            if name not in runners:
                continue
            if name == "triton" and rule != "triton":
                excluded[name] = "not for this head_dim, dtype or fp32 matmul precision (kernels.attention.auto_backend)"
            elif name == "sdpa":
                cap = min(MASK_CAP_BYTES, int(MASK_CAP_FREE_FRACTION * self.free_memory(device)))
                need = mask_bytes(kind)
                if need > cap:
                    excluded[name] = f"its mask takes {need / 2**20:.1f} MiB, over the cap of {cap / 2**20:.1f} MiB"
                    continue
                names.append(name)
            else:
                names.append(name)
        if not names:
            return Choice(rule, "fallback", "no candidate to time", excluded=excluded)
        if len(names) == 1:
            return Choice(names[0], "only candidate", excluded=excluded)
        timer = self.timer or (cuda_timer if device_type == "cuda" else wall_timer)
        times = {}
        for name in names:
            try:
                times[name] = round(float(timer(name, runners[name])), 4)
            except (RuntimeError, ValueError) as err:  # out of memory, a compile or launch failure
                excluded[name] = f"failed while timed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
                if device_type == "cuda":
                    torch.cuda.empty_cache()
        if not times:
            return Choice(rule, "fallback", "every candidate failed while timed", excluded=excluded)
        best = min(times, key=times.get)  # the first of equals: candidates are in order of preference
        choice = Choice(best, "timed", times_ms=times, excluded=excluded)
        self._save(key, choice)
        return choice

    def explain(self) -> str:
        if not self.choices:
            return "attention backend auto: no call yet"
        lines = ["attention backend auto chose:"]
        lines += [f"  {kind.label()}: {choice.describe()}" for kind, choice in self.choices.items()]
        return "\n".join(lines)


def _versions() -> str:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch {torch.__version__}, triton {triton_version}"


_CHOOSER = BackendChooser(choice_file=os.environ.get("ALIBI_VIT_ATTENTION_CHOICES") or None)


def chooser() -> BackendChooser:
    """The process's chooser (what ``backend="auto"`` consults)."""
    return _CHOOSER


@contextlib.contextmanager
def use_chooser(new: BackendChooser):
    """Route ``backend="auto"`` through ``new`` inside the block (tests, benchmarks)."""
    global _CHOOSER
    before, _CHOOSER = _CHOOSER, new
    try:
        yield new
    finally:
        _CHOOSER = before


def use_choice_file(path) -> None:
    """Keep this process's timed choices in ``path`` (JSON) and reuse those already there."""
    _CHOOSER.use_file(path)


def explain() -> str:
    """What ``backend="auto"`` chose for each kind of call so far, and why (timings, exclusions)."""
    return _CHOOSER.explain()
