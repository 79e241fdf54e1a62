"""The one thread that drives the :class:`mmspec.batch.BatchScheduler` (continuous batching).

Owns the scheduler and everything that touches it: the HTTP handlers never call the scheduler;
they hand a :class:`Job` to :meth:`Worker.submit` (any thread) and read :class:`Update` items
from the job's sink. The thread loops: take the queued commands (submit, cancel), then run ONE
scheduler step (one block over every active request; requests that arrived since the last
step are admitted there), then hand each :class:`~mmspec.batch.StepEvent` to its job. So a
request that arrives while others decode joins them at the next block.

Failure isolation: a request the scheduler refuses at submit (``MMSpecError``) or fails alone
(``StepEvent.error``) gets its own error update; the others go on. A step that raises anything
else fails only the requests then in the batch (HTTP 500) and the thread keeps serving.

Shutdown: :meth:`Worker.drain` (SIGTERM) refuses new jobs and gives the running ones until a
deadline to finish; at the deadline each one left is told why (HTTP 503) and its rows freed.
When the batch empties after a burst, the scheduler is renewed (a fresh one, the speculation
policy's measurements carried over: the old one's batch cache, sized for the burst's peak, is
freed) and the heap memory the burst freed goes back to the system (:func:`release_memory`), so
the server's RSS returns near its idle level.
This module knows nothing about HTTP, JSON or prompts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmspec.errors import MMSpecError

log = logging.getLogger("mmspec.serve")


def make_scheduler(decoder, max_batch: int, speculate="always"):
    """The continuous-batching scheduler over ``decoder`` (one place, so it can be swapped);
    ``speculate``: "always", "never", "auto" or a SpeculationPolicy (carried over on renewal)."""
    from mmspec.batch import BatchScheduler

    return BatchScheduler(decoder, max_batch=max_batch, speculate=speculate)


class LoopMailbox:
    """Updates from the worker thread to the queues of one asyncio event loop, with ONE wake-up
    of the loop for what a step hands over (the loop's ``call_soon_threadsafe`` writes to its
    wake-up pipe: 3-25 us of the worker's time each, measured; once per row and step it grew with
    the batch). :meth:`put` (worker thread) appends and schedules a flush unless one is pending;
    the flush (loop thread) puts everything in order into its queues."""

    def __init__(self, loop):
        self.loop = loop
        self._items: list = []
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, inbox, item) -> None:
        with self._lock:
            self._items.append((inbox, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _flush(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for inbox, item in items:
            inbox.put_nowait(item)


@dataclass
class Update:
    """What the worker tells a job. ``kind``: "admitted" (submit accepted it), "rejected" (bad
    request: HTTP 400), "event" (a StepEvent: tokens of one block, maybe the last), "failed"
    (the request could not finish: ``status`` 500 or 503 and why)."""

    kind: str
    event: Any = None  # mmspec.batch.StepEvent for kind "event"
    message: str = ""
    status: int = 400


@dataclass
class Job:
    """One request: what the scheduler runs (a :class:`mmspec.request.Request`, checked and its
    seed chosen on the handler's thread) and the sink that receives its :class:`Update` items,
    called on the worker thread."""

    request: Any
    sink: Callable[[Update], None]
    rid: int | None = None  # the scheduler's id, once admitted
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)
    taken_at: float | None = None  # when the worker thread took it (between two steps) and handed it to the scheduler


class Worker:
    """Drives one scheduler on one thread; every other thread talks to it through a queue."""

    def __init__(self, scheduler, *, renew: Callable[[Any], Any] | None = None, idle_poll_s: float = 0.1):
        self.scheduler = scheduler
        self._renew = renew  # old scheduler -> a fresh one, swapped in when the batch empties (its buffers freed)
        self._commands: queue.Queue = queue.Queue()
        self._jobs: dict[int, Job] = {}  # rid -> job, worker thread only
        self._idle_poll_s = idle_poll_s
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._deadline: float | None = None  # set by drain(): running jobs must end by then
        self._why_stopping = ""
        self.steps = 0  # scheduler steps run (for /health)
        self.active = 0  # jobs admitted and not finished (for /health)
        self.pending = 0  # jobs submitted, not yet taken by the thread

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mmspec-serve-worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; its sink receives "admitted" or "rejected" first."""
        if self._deadline is not None or self._stop.is_set():
            job.sink(Update("failed", message="the server is shutting down and takes no new requests; send the "
                                              "request to another server or again once it is back", status=503))
            return
        self.pending += 1
        self._commands.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """The client went away: free the job's rows at the next step."""
        job.cancelled = True
        self._commands.put(("cancel", job))

    def drain(self, timeout_s: float, why: str) -> None:
        """Take no new jobs; the running ones get ``timeout_s`` seconds, then fail with ``why``."""
        self._why_stopping = why
        self._deadline = time.perf_counter() + timeout_s
        self._commands.put(("wake", None))

    def stop(self, why: str = "the server is shutting down") -> None:
        """End the thread; jobs still running fail with ``why`` (HTTP 503)."""
        self._why_stopping = self._why_stopping or why
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        busy = False
        while not self._stop.is_set():
            try:
                busy = self._turn(busy)
            except Exception as e:  # noqa: BLE001 - the thread must outlive any bug: fail what is running
                log.exception("worker turn failed")
                self._fail_all(500, f"internal error: {e.__class__.__name__}: {e}")
        self._take_commands(block=False)
        self._fail_all(503, self._why_stopping)

    def _turn(self, busy: bool) -> bool:
        """Take the commands, then run one block if there is work; returns whether a burst is on."""
        self._take_commands(block=not self._jobs)
        if self._deadline is not None and time.perf_counter() >= self._deadline:
            self._fail_all(503, self._why_stopping)
        if self._jobs and self.scheduler.has_work():
            self._step()
            return True
        if self._jobs:  # admitted, yet the scheduler has nothing of theirs left: never leave them waiting
            self._fail_all(500, "internal error: the scheduler lost this request; send it again")
            return True
        if busy and not self._jobs:  # the burst is over: its memory goes back
            if self._renew is not None and not self.scheduler.has_work():
                self.scheduler = self._renew(self.scheduler)
            release_memory()
        return False

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._do(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _do(self, what: str, job: Job | None) -> None:
        if what == "submit":
            self.pending -= 1
            if job.cancelled:
                return
            job.taken_at = time.perf_counter()
            try:  # (a job queued before drain() is still taken: drain only closes the door)
                job.rid = self.scheduler.submit(job.request)
            except MMSpecError as e:  # the scheduler's own checks: this request only
                job.sink(Update("rejected", message=_without_index(str(e))))
                return
            except Exception as e:  # noqa: BLE001 - a bug must not end the thread
                log.exception("submit failed")
                job.sink(Update("failed", message=f"internal error at admission: {e.__class__.__name__}: {e}",
                                status=500))
                return
            self._jobs[job.rid] = job
            self.active = len(self._jobs)
            job.sink(Update("admitted"))
        elif what == "cancel" and job.rid is not None and self._jobs.get(job.rid) is job:
            self._forget(job.rid)  # (a renewed scheduler reuses ids: only this job's own)

    def _step(self) -> None:
        try:
            events = self.scheduler.step()
        except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
            log.exception("scheduler step failed")
            self._fail_all(500, f"internal error while decoding: {e.__class__.__name__}: {e}")
            return
        self.steps += 1
        for ev in events:
            job = self._jobs.get(ev.rid)
            if job is None:  # cancelled in the meantime
                continue
            if getattr(ev, "error", None):
                self._jobs.pop(ev.rid)
                job.sink(Update("rejected", message=_without_index(ev.error)))
            else:
                if ev.finished:
                    self._jobs.pop(ev.rid)
                job.sink(Update("event", event=ev))
        self.active = len(self._jobs)

    def _forget(self, rid: int) -> None:
        self._jobs.pop(rid, None)
        self.active = len(self._jobs)
        try:
            self.scheduler.cancel(rid)
        except Exception:  # noqa: BLE001 - an unknown rid (finished meanwhile) is no error here
            log.debug("cancel(%s) failed", rid, exc_info=True)

    def _fail_all(self, status: int, why: str) -> None:
        for rid, job in list(self._jobs.items()):
            self._forget(rid)
            job.sink(Update("failed", message=why, status=status))


def release_memory() -> None:
    """Hand the heap memory a burst of requests freed back to the system (glibc's ``malloc_trim``;
    elsewhere nothing): freed CPU tensors otherwise stay in the allocator's arenas, and the
    server's RSS would stay at its peak after a load has passed."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


def _without_index(message: str) -> str:
    """The scheduler names a bad request's index ("request 0: ..."); a client sent one request."""
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith("request ") and head[8:].isdigit() else message
