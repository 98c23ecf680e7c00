"""services/common/compute.py: which threads start OpenMP teams. Counted as OS threads of a fresh
interpreter, since a team is libgomp worker threads that live as long as the thread that started it."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from services.common import compute

SCRIPT = r"""
import asyncio, json, os, sys, threading
import torch
from services.common import compute

torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
def big_op():
    torch.empty(4_000_000).fill_(1.0)      # far above ATen's grain: parallel when the thread may be
    return threads(), torch.get_num_threads()

out = {"base": threads()}
if sys.argv[1] == "serial":
    out["serial"] = compute.serial_here()
out["main"] = big_op()                       # (threads during, torch's count) on the main thread
def elsewhere():
    out["other"] = big_op()
t = threading.Thread(target=elsewhere)
t.start(); t.join()
async def own():
    during = await compute.in_own_thread(big_op)
    return during, threads()
out["own"] = asyncio.run(own())
print(json.dumps(out))
"""


def run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_the_loop_thread_starts_no_team_once_serial():
    plain, serial = run("plain"), run("serial")
    # Control: a big op on an ordinary thread starts a team of one more thread, kept afterwards.
    assert plain["main"] == [plain["base"] + 1, 2]
    assert serial["serial"] is True
    assert serial["main"] == [serial["base"], 1]                  # inline: no worker thread, count 1
    # Other threads keep torch's count: one more for the thread itself, one for its team.
    assert serial["other"] == [serial["base"] + 2, 2]


def test_a_team_started_in_its_own_thread_leaves_with_it():
    out = run("serial")
    (during, count), after = out["own"]
    assert count == 2 and during == out["base"] + 2                # its thread and its team, while it ran
    assert after == out["base"]                                    # both gone when the await returns


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
