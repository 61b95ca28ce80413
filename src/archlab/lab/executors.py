"""Where a sweep's runs execute: here one after another (`serial`), in N processes on this machine
(`local`), or as Ray tasks on a Ray cluster (`ray`).

The driver (archlab.lab.runner.run_suite) decides which runs are due, writes each row's `running`
record, submits at most `workers` jobs at a time and writes every finished row itself: workers only
train and return a RunRecord, so the SQLite table has one writer whatever the executor. Each job
sets the same torch thread count as the serial runner, so a run's losses are bit-identical wherever
it ran. A worker that dies (killed, out of memory) comes back as a `failed` row; the next sweep runs
it again from its last checkpoint.

Workers must see the sweep folder and the data at the same paths as the driver: on one machine they
do; on a Ray cluster put both on a filesystem every node mounts.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from typing import Any

from archlab.errors import UserError
from archlab.lab.plan import RunJob, crashed
from archlab.lab.store import RunRecord
from archlab.lab.worker import run_job

EXECUTORS = ("serial", "local", "ray")


class Executor:
    """submit() a job, wait() for at least one to finish; `workers` jobs may be in flight at once."""

    name = "?"
    workers = 1

    def submit(self, job: RunJob) -> Any:
        raise NotImplementedError

    def wait(self, handles: list) -> list[tuple[Any, RunRecord]]:
        """(handle, finished row) for every handle that is done now; blocks until at least one is."""
        raise NotImplementedError

    def cancel(self, handles: list) -> None:
        """Stop jobs still in flight (the driver was interrupted)."""

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"{self.name}, {self.workers} worker{'s' * (self.workers != 1)}"


class SerialExecutor(Executor):
    """Runs each job in this process when waited for: the default, and the reference the others equal."""

    name = "serial"

    def submit(self, job: RunJob) -> RunJob:
        return job

    def wait(self, handles: list) -> list[tuple[Any, RunRecord]]:
        return [(handles[0], run_job(handles[0]))]


def _watch_parent(parent: int) -> None:
    """Exit this worker when the driver is gone (killed): its run lock is then free for the next sweep."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(70)


def _local_worker_init(parent: int, gpus: Any) -> None:
    if gpus is not None:          # one GPU per worker process, before torch initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus.get())
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


class LocalExecutor(Executor):
    """N spawned processes on this machine (one GPU each where there are GPUs)."""

    name = "local"

    def __init__(self, workers: int, gpus: int = 0):
        import multiprocessing as mp

        self.workers = min(workers, gpus) if gpus else workers
        self._ctx = mp.get_context("spawn")   # never fork a process that may hold threads or CUDA
        self._gpus = gpus
        self._jobs: dict[futures.Future, RunJob] = {}
        self._pool = self._new_pool()

    def _new_pool(self) -> futures.ProcessPoolExecutor:
        queue = None
        if self._gpus:
            queue = self._ctx.Queue()
            for i in range(self._gpus):
                queue.put(i)
        return futures.ProcessPoolExecutor(self.workers, mp_context=self._ctx, initializer=_local_worker_init,
                                           initargs=(os.getpid(), queue))

    def submit(self, job: RunJob) -> futures.Future:
        try:
            future = self._pool.submit(run_job, job)
        except futures.process.BrokenProcessPool:
            # a worker died after `wait` last looked (its job's future fails on its own, and `wait` records
            # it as a crashed row): this job goes to a fresh pool
            self._pool = self._new_pool()
            future = self._pool.submit(run_job, job)
        self._jobs[future] = job
        return future

    def wait(self, handles: list) -> list[tuple[Any, RunRecord]]:
        done, _ = futures.wait(handles, return_when=futures.FIRST_COMPLETED)
        out, broken = [], False
        for future in done:
            job = self._jobs.pop(future)
            exc = future.exception()
            if exc is None:
                out.append((future, future.result()))
            elif isinstance(exc, futures.process.BrokenProcessPool):   # the worker process died
                broken = True
                out.append((future, crashed(job, f"worker process died: {type(exc).__name__}: {exc}")))
            else:                 # LockedError (another writer runs this row), a job that did not pickle
                raise exc
        if broken:                # every job of a broken pool fails: start a fresh pool for the rest
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
        return out

    def cancel(self, handles: list) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for proc in list((getattr(self._pool, "_processes", None) or {}).values()):   # running workers: stop them
            proc.terminate()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class RayExecutor(Executor):
    """Each job a Ray task: on the cluster at `address`, or on a local Ray instance with `workers` CPUs."""

    name = "ray"

    def __init__(self, workers: int | None, address: str | None, threads: int | None, gpu: bool):
        try:
            import ray
        except ImportError:
            raise UserError("--executor ray needs Ray: pip install 'archlab[ray]' 'torch==2.13.0'") from None
        self._ray = ray
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # archlab does not report usage on your behalf
        per_run = max(1, int(threads or 1))
        started = not ray.is_initialized()
        if started:
            try:
                if address:
                    ray.init(address=address, log_to_driver=False)
                else:
                    ray.init(num_cpus=(workers or os.cpu_count() or 1) * per_run, include_dashboard=False,
                             log_to_driver=False, _node_ip_address="127.0.0.1")
            except ConnectionError as exc:
                raise UserError(f"cannot reach the Ray cluster at {address}: {exc}") from exc
        self._started = started
        resources = ray.cluster_resources()
        n_gpus = int(resources.get("GPU", 0)) if gpu else 0
        capacity = n_gpus if gpu else max(1, int(resources.get("CPU", 1)) // per_run)
        if gpu and not n_gpus:
            raise UserError("--device cuda with --executor ray: the Ray cluster has no GPU")
        self.workers = min(workers, capacity) if workers else capacity
        self._task = ray.remote(run_job).options(num_cpus=per_run, num_gpus=1 if gpu else 0, max_retries=0)
        self._jobs: dict[Any, RunJob] = {}

    def submit(self, job: RunJob) -> Any:
        ref = self._task.remote(job)
        self._jobs[ref] = job
        return ref

    def wait(self, handles: list) -> list[tuple[Any, RunRecord]]:
        ready, _ = self._ray.wait(handles, num_returns=1)
        out = []
        for ref in ready:
            job = self._jobs.pop(ref)
            try:
                out.append((ref, self._ray.get(ref)))
            except UserError:          # LockedError (another writer runs this row): as the serial runner
                raise
            except Exception as exc:   # noqa: BLE001 - WorkerCrashedError, node lost, ...: the row fails
                out.append((ref, crashed(job, f"Ray task failed: {type(exc).__name__}: {exc}")))
        return out

    def cancel(self, handles: list) -> None:
        for ref in handles:
            self._ray.cancel(ref, force=True)

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()


def make_executor(kind: str = "serial", workers: int | None = None, address: str | None = None,
                  threads: int | None = 1, gpu: bool = False) -> Executor:
    """The executor named `kind` (one of EXECUTORS). workers: jobs in flight at once (local default:
    CPU cores // threads, or one per GPU; ray default: what the cluster holds).
    Example: runner.run_suite(suite, "sweeps/x", executor=make_executor("local", workers=2))"""
    if kind not in EXECUTORS:
        raise UserError(f"unknown executor {kind!r}: choose one of {', '.join(EXECUTORS)}")
    if workers is not None and workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if address and kind != "ray":
        raise UserError("--address is the Ray cluster's address: use it with --executor ray")
    if kind == "serial":
        if workers not in (None, 1):
            raise UserError("--workers needs --executor local or ray (serial runs one at a time)")
        return SerialExecutor()
    if kind == "local":
        gpus = 0
        if gpu:
            import torch
            gpus = torch.cuda.device_count()
        default = max(1, (os.cpu_count() or 1) // max(1, int(threads or 1)))
        return LocalExecutor(workers or default, gpus)
    return RayExecutor(workers, address, threads, gpu)
