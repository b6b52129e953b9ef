"""A rank's guard process: stops the rank when its launcher is gone and the rank cannot stop itself.

The watchdog thread (:mod:`.watchdog`) needs the GIL, and DeepSpeed's CPU shared-memory
collectives (its shm comm op: ``initialize`` waiting for the peers' buffers, the allreduce waiting
on their flags) spin in C++ holding it. A rank spinning there for a peer that has already
stopped never lets its watchdog run: with the launcher killed it would spin at 100% CPU forever.
This guard is a separate small process (standard library only, started by path so that it
imports neither torch nor the package): it polls the rank and the launchers above it, and when a
launcher is gone and the rank is still alive ``GRACE_S`` later, it says so in the run's one line
(rank 0's guard; the rank's own watchdog prints it when it can) and SIGKILLs the rank; a rank that
saves a checkpoint before it stops (preempted: the signal took the launcher too) is left until its
saving marker's time. It exits with the rank.

    python launcher_guard.py RANK_PID RANK SAVE_DIR PID:START[,PID:START...]
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

LAUNCHER_WORDS = ("deepspeed", "mpirun", "mpiexec", "orted", "prted", "prterun")
POLL_S = 0.5
GRACE_S = 5.0  # the watchdog thread stops its rank within POLL_S when it can run at all


def process_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a live process, None when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return None if fields[0] in "ZX" else (fields[0], fields[19])


def parent_pid(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text[text.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def launcher_processes(pid: int) -> list[tuple[int, str]]:
    """The launcher processes above ``pid``: (pid, start time), nearest first."""
    chain, pid = [], parent_pid(pid)
    while pid > 1:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            break
        if not any(word in command for word in LAUNCHER_WORDS):
            break
        stat = process_stat(pid)
        if stat is None:
            break
        chain.append((pid, stat[1]))
        pid = parent_pid(pid)
    return chain


RANK_VARIABLES = (b"RANK", b"OMPI_COMM_WORLD_RANK", b"PMI_RANK", b"SLURM_PROCID")  # as launchers set them


def sibling_ranks(launcher: int) -> dict[int, int]:
    """The ranks that ``launcher`` started on this node, {global rank: pid}, from the rank variable
    in each child's environment: known before any process group exists."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or parent_pid(int(entry.name)) != launcher:
            continue
        try:
            items = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        environ = dict(item.split(b"=", 1) for item in items if b"=" in item)
        rank = next((environ[name] for name in RANK_VARIABLES if environ.get(name, b"").isdigit()), None)
        if rank is not None:
            ranks[int(rank)] = int(entry.name)
    return ranks


def launcher_gone(pid: int, launchers: list[tuple[int, str]]) -> int | None:
    """The first launcher above ``pid`` that is gone (or no longer its parent), else None."""
    for launcher, started in launchers:
        stat = process_stat(launcher)
        if stat is None or stat[1] != started:
            return launcher
    if launchers and parent_pid(pid) != launchers[0][0]:
        return launchers[0][0]
    return None


STOP_MARKER = ".stopped-"  # + host-pid, in the run's SAVE_DIR
SAVING_MARKER = ".saving-"  # + host-pid: a preempted rank that saves before it stops, until the time it holds


def stop_marker(save_dir: str, pid: int) -> Path:
    """Left by a rank that stops on purpose (signal, launcher gone, a peer's death), so that its
    peers on the node do not report it as a rank that died. In the run's own folder, not the
    machine's: peers read it after the rank is gone, so no process of the run can remove it
    safely; the next run in that folder does (:func:`clear_stop_markers`). The host in the name:
    ranks of several nodes may share the folder."""
    return Path(save_dir) / f"{STOP_MARKER}{socket.gethostname()}-{pid}"


def mark_stopped(save_dir: str, pid: int):
    """Leaves ``pid``'s stop marker (the folder made if the run stops before its first save)."""
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    stop_marker(save_dir, pid).touch()


def mark_saving(save_dir: str, pid: int, until: float):
    """``pid`` saves a checkpoint before it stops (preempted), until ``until`` at the latest (epoch
    seconds): its guard does not kill it meanwhile, though its launcher is gone."""
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    (Path(save_dir) / f"{SAVING_MARKER}{socket.gethostname()}-{pid}").write_text(str(until))


def saving_until(save_dir: str, pid: int) -> float:
    try:
        return float((Path(save_dir) / f"{SAVING_MARKER}{socket.gethostname()}-{pid}").read_text())
    except (OSError, ValueError):
        return 0.0


def clear_stop_markers(save_dir: str):
    """Removes the markers of this host's processes that are gone or are this one: an earlier
    run's (a pid may come back)."""
    for kind in (STOP_MARKER, SAVING_MARKER):
        prefix = f"{kind}{socket.gethostname()}-"
        for marker in Path(save_dir).glob(f"{prefix}*"):
            pid = marker.name.removeprefix(prefix)
            if not pid.isdigit() or int(pid) == os.getpid() or process_stat(int(pid)) is None:
                marker.unlink(missing_ok=True)


def last_checkpoint(save_dir: str) -> str:
    latest = Path(save_dir) / "latest"
    if latest.is_file():
        return f"last checkpoint {Path(save_dir).resolve()} (tag {latest.read_text().strip()}); continue with --resume"
    return f"no checkpoint in {Path(save_dir).resolve()} yet"


def guard(rank_pid: int, rank: int, save_dir: str, launchers: list[tuple[int, str]]):
    """Polls until the rank is gone; see the module docstring."""
    while process_stat(rank_pid) is not None:
        gone = launcher_gone(rank_pid, launchers)
        if gone is not None:
            time.sleep(GRACE_S)
            while process_stat(rank_pid) is not None and time.time() < saving_until(save_dir, rank_pid):
                time.sleep(POLL_S)  # preempted: the signal took the launcher too, the rank saves first
            if process_stat(rank_pid) is None:
                return
            stopping = stop_marker(save_dir, rank_pid).exists()  # its watchdog ran and said so: no second line
            mark_stopped(save_dir, rank_pid)
            if rank == 0 and not stopping:
                sys.stderr.write(f"ds_mtraining.train: the launcher (pid {gone}) is gone, so every rank stops (rank 0 "
                                 f"was stuck in a collective whose peer had stopped; killed); "
                                 f"{last_checkpoint(save_dir)}\n")
                sys.stderr.flush()
            os.kill(rank_pid, signal.SIGKILL)
            return
        time.sleep(POLL_S)


def main(argv: list[str]):
    # DeepSpeed's launcher stops a failed run by terminating each rank's process tree, this guard
    # included, and kills what is left only 30 s later: the guard outlives SIGTERM/SIGINT (it ends
    # with its rank anyway) so that it can stop a rank that cannot take the signal
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    rank_pid, rank, save_dir, chain = argv
    launchers = [(int(pid), started) for pid, started in (item.split(":") for item in chain.split(",") if item)]
    guard(int(rank_pid), int(rank), save_dir, launchers)


if __name__ == "__main__":
    main(sys.argv[1:])
