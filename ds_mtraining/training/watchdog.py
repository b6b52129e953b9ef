"""How a run stops when something outside it goes wrong: a rank killed, the launcher killed,
Ctrl-C or SIGTERM. Each rank runs a watchdog thread that

* wakes on SIGTERM/SIGINT even while the main thread is blocked inside a collective (the signal's
  C handler writes to a wakeup pipe, :func:`signal.set_wakeup_fd`, which the thread reads);
* polls the launcher processes above the rank (``deepspeed`` runner, ``deepspeed.launcher.launch``,
  ``mpirun``): when one is gone (e.g. SIGKILL of the launcher) the rank exits within a second;
* on a collective that fails because a peer died (gloo: "Connection closed by peer"), names the
  dead rank (ranks on this node are checked by pid).

A thread needs the GIL, which DeepSpeed's CPU shared-memory collectives hold while they spin; a
guard process per rank (:mod:`.launcher_guard`) stops a rank stuck there once its launcher is gone.

Every case ends in one line on stderr, printed by one rank (the lowest survivor, rank 0 for the
launcher and signals), naming what happened and the last checkpoint, then ``os._exit``: no
traceback from the survivors, no hang.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import launcher_guard
from .launcher_guard import (clear_stop_markers, last_checkpoint, launcher_processes, mark_stopped, process_stat,
                             stop_marker)


class Watchdog:
    """See the module docstring. ``start()`` in the main thread before training; ``peers()`` once
    the process group exists; ``step`` kept current by the training loop."""

    def __init__(self, save_dir: str, rank: int):
        self.save_dir, self.rank, self.step = save_dir, rank, 0
        self.launchers = launcher_processes(os.getpid())
        self.peers: dict[int, int] = {}  # rank -> pid, for the ranks on this node
        self._lock = threading.Lock()
        self._read_fd = None

    def start(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals belong to the main thread: nothing to watch from here
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._read_fd = read_fd
        clear_stop_markers(self.save_dir)  # an earlier run's (this pid's among them)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)  # handled by the thread, through the wakeup pipe
        threading.Thread(target=self._run, name="mtraining-watchdog", daemon=True).start()
        if self.launchers:  # the backstop for a rank spinning in C++ with the GIL held
            chain = ",".join(f"{pid}:{started}" for pid, started in self.launchers)
            subprocess.Popen([sys.executable, launcher_guard.__file__, str(os.getpid()), str(self.rank),
                              self.save_dir, chain], stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def know_peers(self):
        """Every rank's host and pid (a collective: call on all ranks after init_distributed)."""
        import torch.distributed as dist
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()))
        self.peers = {rank: pid for rank, (host, pid) in enumerate(everyone) if host == socket.gethostname()}

    # ------------------------------------------------------------------ checks
    def dead_peers(self) -> list[int]:
        return sorted(rank for rank, pid in self.peers.items() if rank != self.rank and process_stat(pid) is None
                      and not stop_marker(self.save_dir, pid).exists())

    def launcher_gone(self) -> int | None:
        return launcher_guard.launcher_gone(os.getpid(), self.launchers)

    def _run(self):
        import select
        while True:
            ready, _, _ = select.select([self._read_fd], [], [], launcher_guard.POLL_S)
            if ready:
                data = os.read(self._read_fd, 64)
                signums = [b for b in data if b in (signal.SIGTERM, signal.SIGINT)]
                if signums:
                    self.on_signal(signums[0])
            self.explain()

    # ------------------------------------------------------------------ exits
    def explain(self):
        """Stops with the cause when there is one: the launcher gone (which explains any peer's
        exit and any signal), else a dead peer; returns otherwise."""
        gone = self.launcher_gone()
        if gone is not None:
            self.stop(f"the launcher (pid {gone}) is gone, so every rank stops at step {self.step}",
                      code=1, printer=0)
        dead = self.dead_peers()
        if dead:
            self.on_dead(dead)

    def on_signal(self, signum: int):
        self.explain()
        name = signal.Signals(signum).name
        self.stop(f"stopped by {name} at step {self.step}", code=128 + signum, printer=0)

    def on_dead(self, dead: list[int]):
        alive = [rank for rank in sorted(self.peers) if rank not in dead] or [self.rank]
        ranks = ", ".join(str(r) for r in dead)
        self.stop(f"rank {ranks} died (killed or crashed) at step {self.step}; the other ranks stop",
                  code=1, printer=alive[0])

    def on_failure(self, error: BaseException):
        """A collective failed in the main thread: a dead peer or a gone launcher explains it (then
        one line and exit); otherwise returns and the caller re-raises."""
        for _ in range(10):  # the dead process may take a moment to become a zombie
            self.explain()
            time.sleep(0.1)
        text = str(error).strip().splitlines()
        if any(word in " ".join(text) for word in ("Connection closed", "Connection reset", "Broken pipe",
                                                      "connection", "Socket Timeout")):
            self.stop(f"a rank on another node stopped at step {self.step} ({text[0] if text else error!r})",
                      code=1, printer=0)

    def stop(self, what: str, code: int, printer: int):
        with self._lock:  # one message per process, even if the thread and the main thread both get here
            try:
                mark_stopped(self.save_dir, os.getpid())
            except OSError:
                pass
            if self.rank == printer:
                sys.stdout.flush()
                sys.stderr.write(f"ds_mtraining.train: {what}; {last_checkpoint(self.save_dir)}\n")
                sys.stderr.flush()
            os._exit(code)
