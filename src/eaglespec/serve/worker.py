"""The engine thread: the only thread that submits to, cancels in and steps the server's engine.

HTTP handlers run on the event loop and must never wait for a step, so they hand requests and
cancellations to this thread through a small inbox, and get each request's new tokens back on an
asyncio queue (`loop.call_soon_threadsafe`). While any request is queued or running the thread
steps the engine back to back; every step advances every running request, so requests that
arrive join the running batch at the next step (continuous batching, done by the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

from ..runtime.engine import Engine, Request
from .metrics import ServerMetrics

log = logging.getLogger("eaglespec.serve")


class QueueFull(Exception):
    """More requests are waiting for a row than the server allows (answered with 429)."""


@dataclass
class Update:
    """What one request produced since the last update. `drafted[i]` says how many leading tokens
    of `chunks[i]` were accepted drafts (the rest are the target's own: prefill or bonus token)."""

    chunks: list[list[int]]
    drafted: list[int]
    done: bool = False
    error: BaseException | None = None


@dataclass
class Job:
    """A request in the server, with the queue its handler reads."""

    req: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted: bool = False  # holds a row (no longer waiting)
    t_first: float | None = None  # when its first token came (time to first token)
    seen_steps: int = 0  # stats already counted in the metrics
    seen_per_pos: list[int] = field(default_factory=list)
    status: str = ""  # finished | cancelled | error, once done

    def post(self, update: Update) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the loop is closed (server gone): nobody is reading
            pass


class EngineWorker:
    """Owns the engine's thread. `submit` and `cancel` are safe from any thread."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int = 128, max_lanes: int = 4) -> None:
        self.engine, self.metrics = engine, metrics
        self.max_waiting, self.max_lanes = max_waiting, max_lanes
        self._cond = threading.Condition()
        self._inbox: list[Job] = []
        self._cancels: list[Job] = []
        self._jobs: dict[int, Job] = {}  # submitted to the engine, not yet done (engine thread only)
        self._waiting = 0  # jobs not yet in a row: inbox + engine queue (under _cond)
        self._running = 0  # jobs holding a row (under _cond, recounted after every step)
        self._stopping = False
        self._paused = False
        self._thread = threading.Thread(target=self._run, name="eaglespec-engine", daemon=True)
        self.failure: BaseException | None = None  # set if the thread itself died (health says so)

    # --- called from the event loop -------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, req: Request, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a checked request; raises QueueFull when max_waiting requests already wait."""
        job = Job(req, loop)
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self._waiting >= self.max_waiting:
                raise QueueFull(f"{self._waiting} requests are already waiting (--max-waiting {self.max_waiting})")
            self._waiting += 1
            self._inbox.append(job)
            self.metrics.set_queue(self._running, self._waiting)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Stop a request (its client went away); its row is freed before the next step."""
        with self._cond:
            self._cancels.append(job)
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything still queued or running and end the thread."""
        with self._cond:
            self._stopping = True
            self._paused = False
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @contextlib.contextmanager
    def paused(self):
        """Tests: hold the engine still (nothing is admitted or stepped) inside the block."""
        with self._cond:
            self._paused = True
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        with self._cond:
            return self._running, self._waiting

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and (self._paused or not (self._inbox or self._cancels or self._jobs)):
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    cancels, self._cancels = self._cancels, []
                    stopping = self._stopping
                if stopping:
                    self._shutdown(inbox)
                    return
                self._cycle(inbox, cancels)
        except BaseException as err:  # a bug in the server itself: fail every request, say so in /health
            self.failure = err
            log.exception("the engine thread stopped")
            for job in list(self._jobs.values()) + self._inbox:
                job.post(Update([], [], True, err))

    def _cycle(self, inbox: list[Job], cancels: list[Job]) -> None:
        e = self.engine
        for job in inbox:
            try:
                e.submit(job.req)
            except Exception as err:  # checked in the handler already; a race with a head change
                self._finish(job, "error", err, admitted=False)
                continue
            self._jobs[job.req.id] = job
        for job in cancels:
            if job.req.id in self._jobs:
                e.cancel(job.req)
        if len(e.lanes) > self.max_lanes:
            e.prune_lanes(self.max_lanes)
        try:
            e.step()
        except Exception:  # the failed requests carry the error (engine.step marks them); others go on
            log.exception("engine step failed")
        waiting = {id(r) for r in e.waiting}
        now = time.perf_counter()
        posts: list[tuple[Job, Update]] = []
        for job in list(self._jobs.values()):
            req = job.req
            if not job.admitted and (req.done or id(req) not in waiting):
                job.admitted = True
                with self._cond:
                    self._waiting -= 1
            chunks, drafted = list(req.pending), list(req.pending_drafted)
            req.pending.clear()
            req.pending_drafted.clear()
            if chunks and job.t_first is None and any(chunks):
                job.t_first = now
                self.metrics.first_token(now - req.t_submit)
            self.metrics.tokens(job, chunks, drafted)
            if req.done:
                del self._jobs[req.id]
                job.status = "error" if req.error else ("cancelled" if req.cancelled else "finished")
                self.metrics.finished(job, job.status)
                posts.append((job, Update(chunks, drafted, True, req.error)))
            elif chunks:
                posts.append((job, Update(chunks, drafted)))
        running = sum(1 for j in self._jobs.values() if j.admitted)
        with self._cond:
            self._running = running
            self.metrics.set_queue(running, self._waiting)
        # Handed over last, so a client that sees its answer end also sees the counts that include it.
        for job, update in posts:
            job.post(update)

    def _finish(self, job: Job, status: str, error: BaseException | None, admitted: bool) -> None:
        """End a job that never reached (or is taken out of) the engine's normal path."""
        if not admitted:
            with self._cond:
                self._waiting -= 1
        job.status = status
        self.metrics.finished(job, status)
        job.post(Update([], [], True, error))

    def _shutdown(self, inbox: list[Job]) -> None:
        for job in inbox:
            job.req.cancelled = True
            self._finish(job, "cancelled", None, admitted=False)
        for job in list(self._jobs.values()):
            self.engine.cancel(job.req)
            del self._jobs[job.req.id]
            self._finish(job, "cancelled", None, admitted=job.admitted)
        with self._cond:
            self._running = 0
            self.metrics.set_queue(0, self._waiting)
