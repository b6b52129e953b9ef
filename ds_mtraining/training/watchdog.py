"""How a run stops when something outside it goes wrong: a rank killed, the launcher killed,
Ctrl-C, SIGTERM or SIGUSR1 (preemption), a rank that makes no progress. Each rank runs a watchdog
thread that

* wakes on SIGTERM/SIGUSR1/SIGINT even while the main thread is blocked inside a collective (the
  signal's C handler writes to a wakeup pipe, :func:`signal.set_wakeup_fd`, which the thread
  reads). Once the training loop runs with checkpoints on, SIGTERM and SIGUSR1 (what schedulers
  send before they kill a job) only set :attr:`Watchdog.preempt`: the loop finishes the step in
  flight, every rank learns it in the step's agreement (:mod:`.step_checks`), saves that step and
  stops (:meth:`Watchdog.preempted`). Before the loop, a second signal, or Ctrl-C (SIGINT): the
  rank stops at once;
* publishes this rank's heartbeat and, when the main thread has made no progress for
  ``mtraining.stall_timeout_s``, stops the run with the stalled rank named (:mod:`.heartbeat`);
* polls the launcher processes above the rank (``deepspeed`` runner, ``deepspeed.launcher.launch``,
  ``mpirun``): when one is gone (e.g. SIGKILL of the launcher) the rank exits within a second;
* on a collective that fails because a peer died (gloo: "Connection closed by peer"), names the
  dead rank (ranks on this node are checked by pid).

A thread needs the GIL, which DeepSpeed's CPU shared-memory collectives hold while they spin; a
guard process per rank (:mod:`.launcher_guard`) stops a rank stuck there once its launcher is gone.

Every case ends in one line on stderr, printed by one rank (the lowest survivor, rank 0 for the
launcher and signals), naming what happened and the last checkpoint, then ``os._exit``: no
traceback from the survivors, no hang. Before the process groups exist, the ranks on this node
are known from the launcher's children (their ``RANK``), so a rank that dies in start-up is named too.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import launcher_guard
from .heartbeat import Heartbeat, main_thread_state
from .launcher_guard import (clear_stop_markers, last_checkpoint, launcher_processes, mark_saving, mark_stopped,
                             process_stat, sibling_ranks, stop_marker)

PREEMPTING = (signal.SIGTERM, signal.SIGUSR1)
SAVE_GRACE_S = 600  # how long the guard lets a preempted rank finish its step and save, its launcher gone


class Watchdog:
    """See the module docstring. ``start()`` in the main thread before training; ``know_peers()``
    once the process groups exist; ``at(phase)`` and ``step`` kept current by the training loop,
    ``preemptible`` set while it runs with checkpoints on."""

    def __init__(self, save_dir: str, rank: int):
        self.save_dir, self.rank, self.step = save_dir, rank, 0
        self.phase, self.moved, self.beats = "start-up", time.monotonic(), 0
        self.launchers = launcher_processes(os.getpid())
        # rank -> pid, for the ranks on this node: the launcher's children until know_peers
        self.peers: dict[int, int] = sibling_ranks(self.launchers[0][0]) if self.launchers else {}
        self.preemptible, self.preempt = False, 0  # preempt: the signal that asked for a save and stop
        self.heartbeat: Heartbeat | None = None
        self.stall_timeout_s = 0.0
        self._main = threading.main_thread().ident
        self._lock = threading.Lock()
        self._read_fd = None

    def start(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals belong to the main thread: nothing to watch from here
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        os.set_blocking(read_fd, False)
        self._read_fd = read_fd
        clear_stop_markers(self.save_dir)  # an earlier run's (this pid's among them)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in (*PREEMPTING, signal.SIGINT):
            signal.signal(signum, lambda *_: None)  # handled by the thread, through the wakeup pipe
        threading.Thread(target=self._run, name="mtraining-watchdog", daemon=True).start()
        if self.launchers:  # the backstop for a rank spinning in C++ with the GIL held
            chain = ",".join(f"{pid}:{started}" for pid, started in self.launchers)
            subprocess.Popen([sys.executable, launcher_guard.__file__, str(os.getpid()), str(self.rank),
                              self.save_dir, chain], stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def know_peers(self, stall_timeout_s: float = 0.0):
        """Every rank's host and pid (a collective: call on all ranks after init_distributed); from
        now on, with ``stall_timeout_s`` > 0, the heartbeat."""
        import torch.distributed as dist
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()))
        self.peers = {rank: pid for rank, (host, pid) in enumerate(everyone) if host == socket.gethostname()}
        if stall_timeout_s > 0:
            self.at("start-up")
            self.stall_timeout_s = stall_timeout_s
            self.heartbeat = Heartbeat(dist.get_rank(), dist.get_world_size())

    def at(self, phase: str):
        """The main thread made progress and is now in ``phase`` (of step ``step + 1``)."""
        self.phase, self.moved, self.beats = phase, time.monotonic(), self.beats + 1

    # ------------------------------------------------------------------ checks
    def dead_peers(self) -> list[int]:
        return sorted(rank for rank, pid in self.peers.items() if rank != self.rank and process_stat(pid) is None
                      and not stop_marker(self.save_dir, pid).exists())

    def launcher_gone(self) -> int | None:
        return launcher_guard.launcher_gone(os.getpid(), self.launchers)

    def _run(self):
        import select
        while True:
            select.select([self._read_fd], [], [], launcher_guard.POLL_S)
            self.take_signals()
            self.explain()
            self.beat()

    def take_signals(self):
        """Handles the signals received since the last call (the wakeup pipe's bytes)."""
        try:
            data = os.read(self._read_fd, 64)
        except BlockingIOError:
            return
        if signal.SIGINT in data:  # Ctrl-C reaches every process, the launcher's SIGTERM after it
            self.on_signal(signal.SIGINT)
        for signum in (s for s in PREEMPTING if s in data):
            self.on_signal(signum)

    def beat(self):
        """Publishes the heartbeat; stops the run on a stall (:mod:`.heartbeat`)."""
        if self.heartbeat is None:
            return
        idle = time.monotonic() - self.moved
        where, waiting = main_thread_state(self._main)
        state = {"pid": os.getpid(), "step": self.step + 1, "phase": self.phase, "beats": self.beats,
                 "idle": idle, "waiting": waiting, "where": where}
        try:
            self.heartbeat.publish(state)
            if idle < self.stall_timeout_s:
                return
            verdict = self.heartbeat.verdict(state)
        except Exception as error:  # noqa: BLE001 - the store's host (rank 0) stopped answering
            if idle < self.stall_timeout_s:
                return
            self.stop(f"rank 0, which holds the run's store, stopped responding (the store: {error}); "
                      f"the job stops", code=1, printer=1)
        if self.rank in verdict["stuck"]:
            sys.stderr.write(f"ds_mtraining: rank {self.rank}'s Python stack, where it made no progress for "
                             f"{idle:.0f} s:\n")
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        self.on_verdict(verdict)

    def on_verdict(self, verdict: dict):
        if self.rank == verdict["printer"]:
            self.stop(verdict["line"], code=1, printer=self.rank, said=self.heartbeat.mark_said)
        self.heartbeat.wait_said()
        self.stop(verdict["line"], code=1, printer=verdict["printer"])

    # ------------------------------------------------------------------ exits
    def explain(self):
        """Stops with the cause when there is one: the launcher gone (which explains any peer's
        exit and any signal; but a preempted rank saves first: the signal took the launcher too),
        else a dead peer; returns otherwise."""
        gone = self.launcher_gone()
        if gone is not None:
            self.take_signals()  # the signal that took the launcher may not be read yet
        if gone is not None and not self.preempt:
            self.stop(f"the launcher (pid {gone}) is gone, so every rank stops at step {self.step}",
                      code=1, printer=0)
        dead = self.dead_peers()
        if dead:
            self.on_dead(dead)

    def on_signal(self, signum: int):
        if signum == signal.SIGINT:  # the user's: nothing else explains it
            self.stop(f"stopped by Ctrl-C (SIGINT) at step {self.step}", code=128 + signum, printer=0)
        if self.preempt:
            return  # saving already: the launcher forwards SIGTERM, schedulers send it again
        if self.preemptible:
            self.preempt = signum  # the loop ends this step, saves it and stops (preempted)
            mark_saving(self.save_dir, os.getpid(), time.time() + SAVE_GRACE_S)  # for the guard
            return
        self.explain()
        self.stop(f"stopped by {signal.Signals(signum).name} at step {self.step}", code=128 + signum, printer=0)

    def preempted(self, signum: int, seconds: float | None):
        """The loop saved step ``step`` in ``seconds`` (None: not saved, a non-finite step) after
        ``signum`` reached some rank."""
        saved = f"saved it in {seconds:.2f} s" if seconds is not None else "not saved (a non-finite step)"
        self.stop(f"stopped by {signal.Signals(signum).name} after finishing step {self.step}: {saved}",
                  code=128 + signum, printer=0)

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
        if self.heartbeat is not None:
            try:  # a stall's verdict, made by a rank that has exited since
                if self.heartbeat.store.check(["verdict"]):
                    self.on_verdict(self.heartbeat.verdict({}))
            except Exception:  # noqa: BLE001 - no store any more: rank 0 is gone, and said why
                pass
        if any(process_stat(pid) is None and stop_marker(self.save_dir, pid).exists()
               for rank, pid in self.peers.items() if rank != self.rank):
            self.stop("", code=1, printer=-1)  # a rank here stopped on purpose and said why
        text = str(error).strip().splitlines()
        if any(word in " ".join(text) for word in ("Connection closed", "Connection reset", "Broken pipe",
                                                      "connection", "Socket Timeout", "Timed out", "timed out")):
            self.stop(f"a collective failed at step {self.step} ({self.phase}): a rank on another node stopped, "
                      f"or it timed out ({text[0] if text else error!r})", code=1, printer=0)

    def stop(self, what: str, code: int, printer: int, said=None):
        """Says ``what`` (and the last checkpoint) if this rank is ``printer``, then exits with ``code``;
        ``said()`` runs after the line is out."""
        with self._lock:  # one message per process, even if the thread and the main thread both get here
            try:
                mark_stopped(self.save_dir, os.getpid())
            except OSError:
                pass
            if self.rank == printer:
                sys.stdout.flush()
                sys.stderr.write(f"ds_mtraining.train: {what}; {last_checkpoint(self.save_dir)}\n")
                sys.stderr.flush()
                if said is not None:
                    said()
            os._exit(code)
