"""Which threads of a service may run parallel torch work: one compute thread, threads that exit
when done, and none else.

Why (measured on 2 vCPUs, AMD EPYC): torch's CPU kernels run on libgomp (GNU OpenMP). Every thread
that starts a parallel region gets a worker team of its own, kept until that thread exits. Once a
process holds more libgomp threads than it has CPUs, libgomp cuts its idle workers' spin from
300,000 iterations to 100 (the throttle GOMP_SPINCOUNT documents), so workers sleep on a futex
between ops and every op waits for their wake-up. A model loaded on asyncio's worker thread (which
lives on) and run on another was enough: batch-1 decode ran at 20 instead of 36 tokens/s and the
pooling forward ~15 % slower, with the cores a third and a sixth idle.

So each service
- runs its steady compute (engine steps, forwards) on one long-lived thread;
- runs one-off torch work (loading, timing paths at load, reading adapters) through
  `in_own_thread`, whose thread takes its team with it when it exits;
- runs its event loop under `serially`, which makes the loop's thread and the loop's default
  executor (asyncio.to_thread) serial, and gives its other worker pools `serial_here` as their
  initializer: the odd tensor op there (stacking replies, decoding a payload, building a grammar's
  token masks) runs inline instead of starting a team that would outlive the request.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

log = logging.getLogger("tessera.compute")

T = TypeVar("T")


async def in_own_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a fresh thread that exits when fn returns (asyncio.to_thread's workers live on,
    and so would any OpenMP team fn started). Its exception, if any, is raised here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result, error: BaseException | None) -> None:
        if done.done():         # the awaiting task was cancelled meanwhile
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def body() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which re-raises it
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:    # the loop has closed: nobody awaits it any more
            pass

    thread = threading.Thread(target=body, name=getattr(fn, "__name__", "compute"), daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if not done.cancelled():
            thread.join()   # it is exiting: wait the moment it takes, so that its team is gone too


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (torch wheels bundle their own), or None if torch runs another OpenMP."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


def serial_here() -> bool:
    """From now on torch runs this thread's ops inline, never with an OpenMP team; other threads keep
    torch's thread count. Call it before this thread's first parallel op. False (and a log line)
    where it cannot be done: torch without libgomp, or no /proc.

    It holds for torch's own ops, not for our C++ operators (services/common/native.py): each shared
    object keeps its own once-per-thread flag for ATen's thread setup, so the first at::parallel_for
    of an operator on this thread sets the process-wide count again (seen: 1 before an encoder
    attention call, 2 after it). Serial threads here never run those operators."""
    # First let ATen initialise this thread's OpenMP settings: it does so once per thread, from the
    # process-wide count, and would undo the setting below if it came later. Asking starts no team.
    torch.get_num_threads()
    try:
        gomp = _libgomp()
    except OSError:
        gomp = None
    if gomp is None:
        log.warning("torch's libgomp was not found; this thread's torch ops may start their own OpenMP team")
        return False
    gomp.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


async def serially(main: Awaitable[T]) -> T:
    """Await main (a service's whole life) with this thread serial, and every worker of the loop's
    default executor too. The entry points call it; tests that serve in-process do not, so that
    their own thread keeps torch's thread count."""
    serial_here()
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(thread_name_prefix="asyncio", initializer=serial_here))
    return await main
