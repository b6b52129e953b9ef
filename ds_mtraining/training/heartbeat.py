"""Stall detection: every rank's heartbeat in the run's store, and one verdict when a run stops
making progress.

The training loop marks its progress (:meth:`.watchdog.Watchdog.at`: a phase of a step, each mark
a beat); each rank's watchdog thread publishes, every ``POLL_S``, where its main thread is: the
step, the phase, its beats, the seconds since its last mark, the innermost Python frame, and
whether it waits inside a collective (a frame of ``torch.distributed`` or ``deepspeed.comm``). The
heartbeats go through the TCP store of the default process group (a connection of its own, with a
short timeout): it answers while every collective is blocked, on any backend and across nodes.

A rank whose own main thread has made no progress for ``mtraining.stall_timeout_s`` asks for the
verdict, or makes it when there is none yet (the first to ask writes it, ``compare_set``):

* ranks whose heartbeat stops (read twice, a second apart) stopped responding: a stopped process,
  a host gone, or a thread spinning in C++ with the GIL held;
* otherwise the ranks not waiting in a collective (a hung file read, a wedged device sync) with
  the fewest beats; when every rank waits in a collective, those with the fewest beats.

The verdict is one line (which rank, its host and pid, the step, the phase and the frame), said by
one rank (a stuck one that still runs, else the lowest that responds), which every other rank
waits for before it exits; each stuck rank that still runs dumps its Python stack
(``faulthandler``) into the log first.
"""
from __future__ import annotations

import json
import socket
import sys
import sysconfig
import time
from datetime import timedelta
from pathlib import Path

POLL_S = 0.5  # how often a rank publishes (the watchdog thread's poll)
STORE_TIMEOUT_S = 10.0  # a store that does not answer within this is gone (its host, rank 0, stopped)
PRINT_WAIT_S = 15.0  # how long a rank that does not say the verdict waits for the one that does
COLLECTIVE_GRACE_S = 60  # the process groups' timeout is stall_timeout_s + this: the verdict comes first
WAITING_IN = ("/torch/distributed/", "/deepspeed/comm/")  # a main thread with such a frame waits for peers
PREFIX = "ds_mtraining/heartbeat/"


def group_timeout(stall_timeout_s: float) -> timedelta:
    """The timeout of every process group of a run: a collective that outlives the heartbeat's
    verdict (the store gone too) still ends. With stall detection off, DeepSpeed's default
    (``DEEPSPEED_TIMEOUT`` minutes)."""
    from deepspeed.constants import default_pg_timeout
    return timedelta(seconds=stall_timeout_s + COLLECTIVE_GRACE_S) if stall_timeout_s > 0 else default_pg_timeout


def standard_library(filename: str) -> bool:
    paths = sysconfig.get_paths()
    return filename.startswith(paths["stdlib"]) and not filename.startswith((paths["purelib"], paths["platlib"]))


def main_thread_state(main_ident: int) -> tuple[str, bool]:
    """(the innermost frame outside the standard library, as ``dir/file.py:line in function``;
    whether a frame waits in a collective)."""
    frame = sys._current_frames().get(main_ident)
    where, waiting = None, False
    while frame is not None:
        filename = frame.f_code.co_filename
        if where is None and not standard_library(filename):
            path = Path(filename)
            where = f"{path.parent.name}/{path.name}:{frame.f_lineno} in {frame.f_code.co_name}"
        waiting = waiting or any(part in filename for part in WAITING_IN)
        frame = frame.f_back
    return where or "?", waiting


class Heartbeat:
    """This rank's heartbeat and the run's verdict, in the default process group's store."""

    def __init__(self, rank: int, world: int):
        import torch.distributed as dist
        store = dist.distributed_c10d._get_default_store().clone()  # a connection of its own
        store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        self.store = dist.PrefixStore(PREFIX, store)
        self.rank, self.world, self.host = rank, world, socket.gethostname()
        self.tick = 0

    def publish(self, state: dict):
        self.tick += 1
        self.store.set(str(self.rank), json.dumps({**state, "host": self.host, "tick": self.tick}))

    def _states(self) -> dict[int, dict]:
        keys = [str(r) for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        return {int(k): json.loads(v) for k, v in zip(present, values)}

    def verdict(self, state: dict) -> dict:
        """The run's verdict (made now if none exists): {"line", "stuck", "printer"}."""
        if self.store.check(["verdict"]):
            return json.loads(self.store.get("verdict"))
        first = self._states()
        for _ in range(2):  # a second for the others' heartbeats to move (ours keeps moving)
            time.sleep(POLL_S)
            self.publish(state)
        states = self._states()
        responsive = {r for r, s in states.items() if r == self.rank or s["tick"] != first.get(r, {}).get("tick")}
        silent = [r for r in range(self.world) if r not in responsive]
        busy = [r for r in sorted(responsive) if not states[r]["waiting"]]
        if silent:
            stuck = silent
        else:
            pool = busy or sorted(responsive)
            fewest = min(states[r]["beats"] for r in pool)
            stuck = [r for r in pool if states[r]["beats"] == fewest]
        running = [r for r in stuck if r in responsive] or sorted(responsive)
        line = describe(stuck, states, silent, every=not silent and not busy and len(stuck) == len(responsive))
        made = json.dumps({"line": line, "stuck": stuck, "printer": running[0]})
        return json.loads(self.store.compare_set("verdict", "", made))

    def mark_said(self):
        self.store.set("said", "1")

    def wait_said(self):
        """Until the verdict's line is out (or ``PRINT_WAIT_S``): this rank may host the store."""
        deadline = time.monotonic() + PRINT_WAIT_S
        try:
            while time.monotonic() < deadline and not self.store.check(["said"]):
                time.sleep(POLL_S / 5)
        except Exception:  # noqa: BLE001 - the store's host said it and exited
            pass


def describe(stuck: list[int], states: dict[int, dict], silent: list[int], every: bool) -> str:
    """The verdict's line (the watchdog adds the last checkpoint)."""
    def where(r):
        s = states.get(r)
        return (f"step {s['step']} ({s['phase']}; {s['where']})" if s else "start-up (it never sent a heartbeat)")

    def who(r):
        s = states.get(r, {})
        return f"rank {r} (host {s.get('host', '?')}, pid {s.get('pid', '?')})"

    first = stuck[0]
    names = ", ".join(who(r) for r in stuck[:4]) + (f" and {len(stuck) - 4} more" if len(stuck) > 4 else "")
    if silent:
        return (f"{names} stopped responding at {where(first)}: its heartbeat stopped (a stopped process, a "
                f"host gone, or C++ spinning with the GIL held); the job stops")
    idle = states[first]["idle"]
    if every:
        return (f"no rank made progress for {idle:.0f} s: every rank waits in a collective at {where(first)}; "
                f"the job stops")
    return (f"{names} made no progress for {idle:.0f} s at {where(first)} while the other ranks waited for "
            f"it (its Python stack is in the log); the job stops")
