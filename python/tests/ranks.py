# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Runs a function on N processes joined by a torch.distributed gloo group, with a deadline.

    results = run_ranks(fn, 2, args=(...))   # fn(rank, world, group, *args) -> picklable

Each process gets its own rank (the processes stay for the next call of the same
world size while calls succeed; each call gets a process group of its own); what fn returns (or raises) comes back in rank order. A
process that has not finished by `timeout` seconds fails the call (and is killed): nothing
waits forever. fn must be a module-level function (it is pickled), and should return plain
values (numbers, strings, lists), not tensors: a tensor's storage is shared through the
process that made it, which may have exited by the time the caller reads it. Compare inside
the ranks.
"""
import atexit
import datetime
import os
import queue
import sys
import tempfile
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))


class RankFailed(Exception):
    """What a rank raised: its type name, message and traceback text."""

    def __init__(self, rank, kind, message, text):
        super().__init__(f"rank {rank}: {kind}: {message}\n{text}")
        self.rank, self.kind, self.message = rank, kind, message


def _call(rank, world, path, fn, args, pg_timeout):
    """fn on a fresh process group: (rank, ok, value)."""
    try:
        dist.init_process_group("gloo", init_method="file://" + path, rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            return rank, True, fn(rank, world, dist.group.WORLD, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything goes back to the test
        return rank, False, (type(e).__name__, str(e), traceback.format_exc())


def _worker(rank, world, tasks, results):
    """A rank that stays: runs each call it is sent, each on a process group of its own."""
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    while (task := tasks.get()) is not None:
        results.put(_call(rank, world, *task))


class _Pool:
    """`world` spawned processes that import torch once and run call after call: starting two
    processes that import torch costs seconds of CPU, once per test file instead of once per
    call. Any failure or timeout retires the pool (its ranks may be stuck in a collective), so
    every call after it starts from fresh processes."""

    def __init__(self, world):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def close(self, kill):
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()


_pools = {}


def _pool(world):
    if world not in _pools:
        _pools[world] = _Pool(world)
        atexit.register(_retire, world, False)
    return _pools[world]


def _retire(world, kill=True):
    pool = _pools.pop(world, None)
    if pool is not None:
        pool.close(kill)


def run_ranks(fn, world, args=(), timeout=300.0, pg_timeout=240.0, raise_errors=True):
    """fn(rank, world, group, *args) on `world` processes; its results in rank order. With
    raise_errors=False a rank's exception comes back as a RankFailed in its place. The
    deadlines catch hangs, not slowness: a loaded 2-core machine takes tens of seconds to
    start two processes that import torch. The processes are kept for the next call while
    every call succeeds (each call gets a process group of its own)."""
    pool = _pool(world)
    healthy = False
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        for q in pool.tasks:
            q.put((path, fn, args, pg_timeout))
        got = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world:
                try:
                    rank, ok, value = pool.results.get(
                        timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(got))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout} s "
                                       "(a hang)") from None
                got[rank] = value if ok else RankFailed(rank, *value)
            healthy = all(not isinstance(v, RankFailed) for v in got.values())
        finally:
            if not healthy:
                _retire(world)
    out = [got[r] for r in range(world)]
    if raise_errors:
        for v in out:
            if isinstance(v, RankFailed):
                raise v
    return out
