# SPDX-FileCopyrightText: 2026 The epmoe authors
# SPDX-License-Identifier: Apache-2.0
"""Runs a function on N processes joined by a torch.distributed gloo group, with a deadline.

    results = run_ranks(fn, 2, args=(...))   # fn(rank, world, group, *args) -> picklable

Each process gets its own rank; what fn returns (or raises) comes back in rank order. A
process that has not finished by `timeout` seconds fails the call (and is killed): nothing
waits forever. fn must be a module-level function (it is pickled), and should return plain
values (numbers, strings, lists), not tensors: a tensor's storage is shared through the
process that made it, which may have exited by the time the caller reads it. Compare inside
the ranks.
"""
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


def _main(rank, world, path, fn, args, results, pg_timeout):
    try:
        sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        dist.init_process_group("gloo", init_method="file://" + path, rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            results.put((rank, True, fn(rank, world, dist.group.WORLD, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - everything goes back to the test
        results.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))


def run_ranks(fn, world, args=(), timeout=300.0, pg_timeout=240.0, raise_errors=True):
    """fn(rank, world, group, *args) on `world` processes; its results in rank order. With
    raise_errors=False a rank's exception comes back as a RankFailed in its place. The
    deadlines catch hangs, not slowness: a loaded 2-core machine takes tens of seconds to
    start two processes that import torch."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_main, args=(r, world, path, fn, args, results, pg_timeout))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world:
                try:
                    rank, ok, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(got))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout} s "
                                       "(a hang)") from None
                got[rank] = value if ok else RankFailed(rank, *value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    out = [got[r] for r in range(world)]
    if raise_errors:
        for v in out:
            if isinstance(v, RankFailed):
                raise v
    return out
