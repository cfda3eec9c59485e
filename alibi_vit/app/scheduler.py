"""The app's compute queue: one worker thread that runs tasks by priority, coalesces repeated
requests, lets long background work give way, and drops work nobody waits for any more.

One thread, because features, training and prediction share the segmenter and its feature cache,
and on a two-core machine two of them at once only slow both down. Priorities, because what the
user waits for (a Train, the prediction of the image on screen) must not queue behind background
work such as the features of every image opened before, a 4096² image among them.

- Each task has a key. Submitting a key that is queued, or running, joins that task (a prediction
  asked for twice is computed once) and raises its priority if the new request's is higher;
  ``replace=True`` instead supersedes a queued task, whose requests fail with 409: the newest Train
  request wins, however many arrive.
- The lowest priority number runs first; among equals, the oldest.
- A running task calls :meth:`Scheduler.checkpoint` between steps (tiles). When a more urgent task
  is queued it gives the worker back and is queued again (what it computed stays in the feature
  cache), and when it was cancelled it stops there.
- A task submitted for requests (``keep=False``) is dropped once every request that asked for it
  has gone away (the client disconnected): before it starts, or at its next checkpoint. A flood of
  abandoned requests leaves nothing behind.

Work a request does on its own thread rather than the worker (building a display tile) is dropped the
same way: the request marks it abandoned (:func:`abandoned_when`) and the work calls
:func:`request_checkpoint` between steps.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import heapq
import itertools
import threading
import traceback
from concurrent.futures import Future

from .errors import SessionError

__all__ = ["Cancelled", "Scheduler", "Task", "abandoned_when", "request_checkpoint"]

# Set while a request's own work runs (copied into the thread it runs on): set once its client has gone.
_abandoned: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("abandoned", default=None)


class _GiveWay(BaseException):
    """Raised by checkpoint() inside a task to give the worker to a more urgent task (a BaseException,
    so that a task's own ``except Exception`` does not swallow it)."""


class Cancelled(SessionError):
    """A task was cancelled (or superseded, or nobody waits for it): 409."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message, status)


class Task:
    """A unit of work: ``fn()`` on the worker thread; ``future`` holds its result or error."""

    def __init__(self, key, fn, priority: int, seq: int, keep: bool):
        self.key, self.fn, self.priority, self.seq, self.keep = key, fn, priority, seq, keep
        self.future: Future = Future()
        self.waiters = 0
        self.state = "queued"  # queued, running, done
        self.cancelled: Cancelled | None = None

    def __repr__(self) -> str:
        return f"Task({self.key!r}, priority {self.priority}, {self.state})"


class Scheduler:
    """Runs submitted tasks on one worker thread (see the module docstring); an exception other than
    a SessionError is printed with its traceback (the server's log) and handed to the waiters."""

    def __init__(self, name: str = "alibi-vit-app"):
        self._cond = threading.Condition()
        self._heap: list[tuple[int, int, Task]] = []
        self._queued: dict = {}  # key → queued task
        self._current: Task | None = None
        self._seq = itertools.count()
        self._closed = False
        self.completed = collections.deque(maxlen=1000)  # keys of the tasks that ran to the end, in order
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    # ---- submitting -------------------------------------------------------------------------
    def submit(self, key, fn, priority: int, *, replace: bool = False, keep: bool = False) -> Task:
        """Queue ``fn`` under ``key`` (or join the task already there); returns the task. ``keep``:
        run it even when no request waits for it (background work). A caller that waits must pair
        this with :meth:`release` when it stops waiting."""
        with self._cond:
            if self._closed:
                raise SessionError("the server is shutting down", status=503)
            task = self._queued.get(key)
            if task is not None and replace:
                self._drop(task, Cancelled("superseded by a newer request of the same kind"))
                task = None
            if task is None and not replace and self._current is not None and self._current.key == key \
                    and self._current.cancelled is None:
                task = self._current
            if task is None:
                task = Task(key, fn, priority, next(self._seq), keep)
                self._queued[key] = task
                heapq.heappush(self._heap, (priority, task.seq, task))
            elif task.state == "queued" and priority < task.priority:
                task.priority = priority
                heapq.heappush(self._heap, (priority, task.seq, task))
            task.keep = task.keep or keep
            if not keep:
                task.waiters += 1
            self._cond.notify()
            return task

    def release(self, task: Task) -> None:
        """A request stopped waiting for ``task``: a task nobody waits for any more is dropped if
        queued, and stopped at its next checkpoint if running."""
        with self._cond:
            task.waiters -= 1
            if task.waiters > 0 or task.keep:
                return
            if task.state == "queued":
                self._drop(task, Cancelled("cancelled: nobody waits for it any more"))
            elif task.state == "running" and task.cancelled is None:
                task.cancelled = Cancelled("cancelled: nobody waits for it any more")

    def reprioritise(self, match, priority: int) -> None:
        """Give every task whose key satisfies ``match(key)`` the priority ``priority`` (a running one
        gives way at its next checkpoint when that makes a queued task more urgent)."""
        with self._cond:
            for task in self._queued.values():
                if match(task.key) and task.priority != priority:
                    task.priority = priority
                    heapq.heappush(self._heap, (priority, task.seq, task))
            if self._current is not None and match(self._current.key):
                self._current.priority = priority

    def cancel(self, match, reason: str) -> None:
        """Cancel the tasks whose key satisfies ``match(key)``: queued ones at once, a running one at
        its next checkpoint; their requests get a 409 with ``reason``."""
        with self._cond:
            for task in [t for t in self._queued.values() if match(t.key)]:
                self._drop(task, Cancelled(reason))
            if self._current is not None and match(self._current.key):
                self._current.cancelled = Cancelled(reason)

    def _drop(self, task: Task, err: Cancelled) -> None:
        # Caller holds the lock. The heap entry stays behind and is skipped when popped.
        if self._queued.get(task.key) is task:
            del self._queued[task.key]
        task.state = "done"
        task.future.set_exception(err)

    # ---- inside a task ------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Called by a running task between steps: stops it when it was cancelled, and hands the
        worker to a more urgent queued task (the task is queued again)."""
        with self._cond:
            task = self._current
            if task is None:
                return
            if task.cancelled is not None:
                raise task.cancelled
            urgent = self._peek()
            if urgent is not None and urgent.priority < task.priority:
                raise _GiveWay()

    def _peek(self) -> Task | None:
        while self._heap:
            priority, _, task = self._heap[0]
            if task.state == "queued" and task.priority == priority and self._queued.get(task.key) is task:
                return task
            heapq.heappop(self._heap)
        return None

    # ---- the worker -----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                task = self._peek()
                while task is None and not self._closed:
                    self._cond.wait()
                    task = self._peek()
                if task is None:
                    return
                heapq.heappop(self._heap)
                del self._queued[task.key]
                task.state, self._current = "running", task
            try:
                result = task.fn()
            except _GiveWay:
                with self._cond:
                    self._current = None
                    if task.key in self._queued:  # joined meanwhile by a newer task of that key: it takes over
                        self._queued[task.key].future.add_done_callback(lambda f, t=task: _copy(f, t.future))
                        task.state = "done"
                    else:
                        task.state = "queued"
                        self._queued[task.key] = task
                        heapq.heappush(self._heap, (task.priority, task.seq, task))
                continue
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits
                if not isinstance(err, SessionError):
                    traceback.print_exc()
                outcome = (task.future.set_exception, err)
            else:
                outcome = (task.future.set_result, result)
                self.completed.append(task.key)
            with self._cond:
                task.state, self._current = "done", None
            outcome[0](outcome[1])

    def close(self) -> None:
        """Refuse new tasks, cancel the queued ones and the running one (at its next checkpoint), and
        wait for the worker to stop."""
        with self._cond:
            self._closed = True
            for task in list(self._queued.values()):
                self._drop(task, Cancelled("the server is shutting down", status=503))
            if self._current is not None:
                self._current.cancelled = Cancelled("the server is shutting down", status=503)
            self._cond.notify_all()
        self._thread.join()

    def queued(self) -> list:
        """Keys of the tasks waiting to run, most urgent first."""
        with self._cond:
            return [t.key for t in sorted(self._queued.values(), key=lambda t: (t.priority, t.seq))]

    def busy(self) -> bool:
        """Whether a task runs or waits."""
        with self._cond:
            return self._current is not None or self._peek() is not None


@contextlib.contextmanager
def abandoned_when(gone: threading.Event):
    """Within the block, work started in this context (and the threads and tasks it is copied into)
    is abandoned once ``gone`` is set: its :func:`request_checkpoint` stops it."""
    token = _abandoned.set(gone)
    try:
        yield
    finally:
        _abandoned.reset(token)


def request_checkpoint() -> None:
    """Called between steps of work a request does on its own thread: a 499 :class:`Cancelled` once
    its client has gone (:func:`abandoned_when`); nothing outside such work."""
    gone = _abandoned.get()
    if gone is not None and gone.is_set():
        raise Cancelled("the client went away: its work was stopped", status=499)


def _copy(source: Future, target: Future) -> None:
    if target.done():
        return
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
