"""services/common/compute.py: which threads start OpenMP teams. Counted as OS threads of a fresh
interpreter per scenario, since a team is libgomp worker threads that live as long as the thread that
started it (a freed team's workers exit on their own, so counts are read once they have settled)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from services.common import compute

SCRIPT = r"""
import asyncio, json, os, sys, threading, time
import torch
from services.common import compute

torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def settled():
    # The count once it has held still for 0.2 s (workers of a freed team exit on their own).
    last, since, deadline = threads(), time.monotonic(), time.monotonic() + 10
    while time.monotonic() - since < 0.2 and time.monotonic() < deadline:
        time.sleep(0.01)
        now = threads()
        if now != last:
            last, since = now, time.monotonic()
    return last
def big_op():
    torch.empty(4_000_000).fill_(1.0)      # far above ATen's grain: parallel where the thread may be
    return threads(), torch.get_num_threads()

mode, out = sys.argv[1], {}
if mode != "plain":
    compute.serial_here()
out["base"] = settled()
out["main"] = big_op()                       # (threads during, torch's count) on the main thread
if mode == "serial":
    t = threading.Thread(target=lambda: out.__setitem__("other", big_op()))
    t.start(); t.join()
elif mode == "own":
    out["own"] = asyncio.run(compute.in_own_thread(big_op))
    out["after"] = settled()
elif mode == "serially":
    async def served():
        before = settled()
        return before, big_op(), await asyncio.to_thread(big_op)
    out["serially"] = asyncio.run(compute.serially(served()))
print(json.dumps(out))
"""


def run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_the_loop_thread_starts_no_team_once_serial():
    plain, serial = run("plain"), run("serial")
    # Control: a big op on an ordinary thread starts a team of one more thread.
    assert plain["main"] == [plain["base"] + 1, 2]
    assert serial["main"] == [serial["base"], 1]                  # inline: no worker thread, count 1
    # Other threads keep torch's count: one more for the thread itself, one for its team.
    assert serial["other"] == [serial["base"] + 2, 2]


def test_a_team_started_in_its_own_thread_leaves_with_it():
    out = run("own")
    assert out["own"] == [out["base"] + 2, 2]                      # its thread and its team, while it ran
    assert out["after"] == out["base"]                             # both gone afterwards


def test_serially_makes_the_loop_and_its_default_executor_serial():
    before, on_loop, elsewhere = run("serially")["serially"]
    assert on_loop == [before, 1]
    assert elsewhere == [before + 1, 1]                            # the executor's worker, no team


def test_in_own_thread_returns_raises_and_runs_elsewhere():
    async def go():
        ident = await compute.in_own_thread(threading.get_ident)
        with pytest.raises(ValueError, match="refused"):
            await compute.in_own_thread(lambda: (_ for _ in ()).throw(ValueError("refused")))
        return ident
    assert asyncio.run(go()) != threading.get_ident()


def test_in_own_thread_can_be_cancelled_without_waiting_for_it():
    release = threading.Event()

    async def go():
        task = asyncio.ensure_future(compute.in_own_thread(release.wait, 30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()    # the thread was left to finish on its own; the loop never blocked on it
        return True
    assert asyncio.run(asyncio.wait_for(go(), 10))
