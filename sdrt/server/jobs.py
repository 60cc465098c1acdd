"""sd-server's AsyncJobManager: one worker thread owns the pipeline (and its device); every API
family submits jobs here. Jobs are queued (at most `max_pending`, else QueueFull -> 429), run one at
a time, and kept `ttl` seconds after they finish (then 410). Cancellation reaches the sampler
between steps: the progress callback raises `JobCancelled` when the job's cancel flag is set.

Pure Python and threading only: no web framework here, so the manager is testable on its own."""
from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

from ..errors import SdrtError, UsageError

log = logging.getLogger("sdrt.server")

__all__ = ["Job", "JobCancelled", "JobManager", "QueueFull", "JobGone", "JobNotFound", "ShuttingDown"]

STATES = ("queued", "generating", "completed", "failed", "cancelled")
FINISHED = ("completed", "failed", "cancelled")


class JobCancelled(Exception):
    """Raised from the progress callback to stop the sampler between steps."""


class QueueFull(SdrtError):
    pass


class JobNotFound(SdrtError):
    pass


class JobGone(SdrtError):
    pass


class ShuttingDown(SdrtError):
    pass


@dataclass
class Job:
    kind: str
    work: object                       # what the runner takes (sdrt.server.params.Request)
    id: str = field(default_factory=lambda: "job_" + secrets.token_urlsafe(18))  # 144 random bits
    status: str = "queued"
    created: int = field(default_factory=lambda: int(time.time()))
    started: int | None = None
    completed: int | None = None
    result: object = None
    error: dict | None = None
    step: int = 0
    steps: int = 0
    image_index: int = 0
    finished_at: float = 0.0           # monotonic, for the TTL
    cancel_flag: threading.Event = field(default_factory=threading.Event)
    _waiters: list = field(default_factory=list)

    def public(self, queue_position: int = 0) -> dict:
        return {"id": self.id, "kind": self.kind, "status": self.status, "created": self.created,
                "started": self.started, "completed": self.completed, "queue_position": queue_position,
                "progress": {"step": self.step, "steps": self.steps, "image": self.image_index},
                "result": self.result if self.status == "completed" else None, "error": self.error}


class JobManager:
    """`runner(job, progress)` does the work in the worker thread and returns the job's result;
    `progress(step, steps)` raises JobCancelled once the job is cancelled."""

    def __init__(self, runner, *, max_pending: int = 64, ttl: float = 600.0, clock=time.monotonic):
        self.runner, self.max_pending, self.ttl, self.clock = runner, max_pending, ttl, clock
        self.jobs: dict[str, Job] = {}
        self.queue: collections.deque[Job] = collections.deque()
        self.expired: collections.OrderedDict[str, None] = collections.OrderedDict()  # ids answered 410
        self.current: Job | None = None
        self.counts = collections.Counter()        # submitted / completed / failed / cancelled / rejected
        self.cv = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="sdrt-generation-worker", daemon=True)
        self.thread.start()

    # ---- requests (any thread) ------------------------------------------------------------------
    def submit(self, kind: str, work) -> Job:
        with self.cv:
            self._purge()
            if self.stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self.queue) + (self.current is not None) >= self.max_pending:
                self.counts["rejected"] += 1
                raise QueueFull("job queue is full")
            job = Job(kind, work)
            self.jobs[job.id] = job
            self.queue.append(job)
            self.counts["submitted"] += 1
            self.cv.notify_all()
            return job

    def get(self, job_id: str) -> Job:
        with self.cv:
            self._purge()
            job = self.jobs.get(job_id)
            if job is None:
                raise JobGone("job expired") if job_id in self.expired else JobNotFound("job not found")
            return job

    def position(self, job: Job) -> int:
        """1-based place among the queued jobs (0 when not queued), as sd-server reports it."""
        with self.cv:
            for i, j in enumerate(self.queue):
                if j is job:
                    return i + 1
            return 0

    def cancel(self, job_id: str) -> Job:
        """Cancel a queued (at once) or generating (at the next step) job; JobNotFound / JobGone;
        returns the job; a finished job is returned unchanged (the caller answers 409)."""
        with self.cv:
            job = self.get(job_id)
            self._cancel_locked(job, "cancelled", "job cancelled by client")
            return job

    def _cancel_locked(self, job: Job, code: str, message: str) -> None:
        if job.status == "queued":
            self.queue.remove(job)
            self._finish(job, "cancelled", error={"code": code, "message": message})
        elif job.status == "generating":
            job.error = {"code": code, "message": message}
            job.cancel_flag.set()

    def interrupt_current(self) -> bool:
        with self.cv:
            if self.current is None:
                return False
            self._cancel_locked(self.current, "cancelled", "job interrupted")
            return True

    def snapshot(self) -> dict:
        with self.cv:
            cur = self.current
            return {"current": None if cur is None else cur.public(0),
                    "queued": [j.public(i + 1) for i, j in enumerate(self.queue)],
                    "counts": dict(self.counts), "jobs_kept": len(self.jobs)}

    async def wait(self, job: Job) -> None:
        """Await the job's end from an event loop (the worker thread wakes the loop)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.cv:
            if job.status in FINISHED:
                return
            job._waiters.append((loop, fut))
        await fut

    def shutdown(self, grace: float = 30.0) -> None:
        """Refuse new jobs, cancel the queued ones, let the running one finish for `grace` seconds,
        then cancel it (it ends at its next step as 'cancelled', or 'failed' if it errs)."""
        with self.cv:
            self.stopping = True
            while self.queue:
                self._finish(self.queue.popleft(), "cancelled",
                             error={"code": "server_shutdown", "message": "the server is shutting down"})
            self.cv.notify_all()
        self.thread.join(grace)
        with self.cv:
            if self.current is not None:
                self._cancel_locked(self.current, "server_shutdown", "the server is shutting down")
        self.thread.join(max(grace, 5.0))

    # ---- the worker ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stopping:
                    self.cv.wait(timeout=5.0)
                    self._purge()
                if not self.queue:
                    return
                job = self.queue.popleft()
                job.status, job.started = "generating", int(time.time())
                self.current = job
            self._run(job)

    def _run(self, job: Job) -> None:
        def progress(step, steps, *_):
            job.step, job.steps = int(step), int(steps)
            if job.cancel_flag.is_set():
                raise JobCancelled()

        try:
            if job.cancel_flag.is_set():
                raise JobCancelled()
            result = self.runner(job, progress)
        except JobCancelled:
            self._end(job, "cancelled", error=job.error or {"code": "cancelled", "message": "job cancelled by client"})
        except UsageError as e:             # a request the engine refuses (the server's checks missed it)
            self._end(job, "failed", error={"code": "invalid_request", "message": str(e)})
        except SdrtError as e:
            self._end(job, "failed", error={"code": "generation_failed", "message": str(e)})
        except Exception as e:  # noqa: BLE001 - the worker must survive anything a job does
            log.exception("job %s failed", job.id)
            self._end(job, "failed", error={"code": "generation_failed", "message": f"{type(e).__name__}: {e}"})
        else:
            if job.cancel_flag.is_set():       # cancelled after the last step: the client asked, honour it
                self._end(job, "cancelled", error=job.error or {"code": "cancelled", "message": "job cancelled by client"})
            else:
                self._end(job, "completed", result=result)

    def _end(self, job: Job, status: str, *, result=None, error=None) -> None:
        with self.cv:
            self.current = None
            self._finish(job, status, result=result, error=error)

    def _finish(self, job: Job, status: str, *, result=None, error=None) -> None:
        job.status, job.result, job.error = status, result, error if status != "completed" else None
        job.completed, job.finished_at = int(time.time()), self.clock()
        job.work = None                     # drop the request's images now
        self.counts[status] += 1
        for loop, fut in job._waiters:
            loop.call_soon_threadsafe(_resolve, fut)
        job._waiters.clear()

    def _purge(self) -> None:
        now = self.clock()
        for jid in [j.id for j in self.jobs.values() if j.status in FINISHED and now - j.finished_at > self.ttl]:
            del self.jobs[jid]
            self.expired[jid] = None
        while len(self.expired) > 100_000:          # bounded memory of expired ids
            self.expired.popitem(last=False)


def _resolve(fut) -> None:
    if not fut.done():
        fut.set_result(None)
