"""The rank's guard process (ds_mtraining.training.launcher_guard) with stand-in processes: a fake
launcher (its command line names deepspeed) whose child spins in a busy loop, as a rank does inside
DeepSpeed's shm collectives with the GIL held, where its watchdog thread cannot run. And where a
rank that stops on purpose leaves its mark: in the run's folder, never the machine's."""
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from helpers import environment

from ds_mtraining.training import launcher_guard

SPIN = "while True: pass"
LAUNCHER = ("import subprocess, sys, time; rank = subprocess.Popen([sys.executable, '-c', sys.argv[1]]); "
            "print(rank.pid, flush=True); time.sleep(120)")


def start_launcher_and_rank(rank_code: str):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, rank_code, "deepspeed"], stdout=subprocess.PIPE,
                                text=True)
    rank_pid = int(launcher.stdout.readline())
    chain = launcher_guard.launcher_processes(rank_pid)
    assert chain and chain[0][0] == launcher.pid, chain
    return launcher, rank_pid, chain


@pytest.fixture(scope="module", autouse=True)
def preempted(tmp_path_factory):
    """A rank in its training loop, under a fake launcher, both sent SIGTERM once it watches
    (:func:`test_a_preempted_rank_saves_though_the_signal_took_its_launcher` checks the rest).
    Started with the module, by a thread, so that the rank's stay past the guard's grace overlaps
    the other tests, which mostly wait too."""
    folder = tmp_path_factory.mktemp("preempted")
    code = textwrap.dedent(f"""
        import time
        from ds_mtraining.training.watchdog import Watchdog
        watchdog = Watchdog({str(folder / "run")!r}, rank=0).start()
        watchdog.preemptible = True  # in the training loop, checkpoints on
        print("watching", flush=True)
        while not watchdog.preempt:
            time.sleep(0.05)
        time.sleep({launcher_guard.GRACE_S + 1.5})  # the step in flight, then its save
        open({str(folder / "saved")!r}, "w").write("saved")
        watchdog.preempted(watchdog.preempt, 1.0)
    """)
    with (folder / "err.txt").open("w") as stderr:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, code, "deepspeed"], stdout=subprocess.PIPE,
                                    stderr=stderr, text=True, env=environment())
    rank_pid = int(launcher.stdout.readline())
    outcome = {"folder": folder, "launcher": launcher, "rank": rank_pid}

    def signal_both():
        outcome["watching"] = launcher.stdout.readline() == "watching\n"
        launcher.send_signal(signal.SIGTERM)
        subprocess.run(["kill", "-TERM", str(rank_pid)])
        outcome["signalled"] = time.monotonic()
    outcome["thread"] = thread = threading.Thread(target=signal_both, daemon=True)
    thread.start()
    yield outcome
    thread.join(60)
    subprocess.run(["kill", "-9", str(rank_pid)], capture_output=True)
    launcher.kill()
    launcher.wait()


def run_guard(rank_pid, rank, save_dir, chain):
    return subprocess.Popen([sys.executable, launcher_guard.__file__, str(rank_pid), str(rank), str(save_dir),
                             ",".join(f"{pid}:{started}" for pid, started in chain)], stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_guard_kills_a_spinning_rank_once_its_launcher_is_gone(tmp_path, rank):
    """Launcher SIGKILLed: within POLL_S + GRACE_S (+ start-up) the spinning rank is killed; rank
    0's guard says so in the run's one line, another rank's guard says nothing. The guard outlives
    the SIGTERM that DeepSpeed's launcher sends to a failed rank's process tree."""
    launcher, rank_pid, chain = start_launcher_and_rank(SPIN)
    guard = run_guard(rank_pid, rank, tmp_path, chain)
    try:
        time.sleep(1.0)
        guard.terminate()  # as DeepSpeed's launcher terminates a failed rank's process tree
        time.sleep(0.5)
        assert guard.poll() is None and launcher_guard.process_stat(rank_pid) is not None  # nothing gone yet
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        _, err = guard.communicate(timeout=launcher_guard.GRACE_S + 20)
        assert launcher_guard.process_stat(rank_pid) is None
        assert time.monotonic() - killed < launcher_guard.GRACE_S + 10
    finally:
        subprocess.run(["kill", "-9", str(rank_pid)], capture_output=True)
    assert [p.name for p in tmp_path.iterdir()] == [launcher_guard.stop_marker(tmp_path, rank_pid).name]  # for peers
    lines = err.strip().splitlines()
    if rank == 0:
        assert lines == [f"ds_mtraining.train: the launcher (pid {launcher.pid}) is gone, so every rank stops (rank 0 "
                         f"was stuck in a collective whose peer had stopped; killed); no checkpoint in "
                         f"{tmp_path.resolve()} yet"], err
    else:
        assert lines == [], err


def test_guard_leaves_a_rank_that_stops_by_itself_and_exits_with_it(tmp_path):
    """A rank that exits on its own (its watchdog's os._exit): the guard exits too, says nothing
    and kills nothing."""
    launcher, rank_pid, chain = start_launcher_and_rank("import time; time.sleep(1.5)")
    guard = run_guard(rank_pid, 0, tmp_path, chain)
    _, err = guard.communicate(timeout=30)
    launcher.kill()
    launcher.wait()
    assert guard.returncode == 0 and err == ""


@pytest.mark.parametrize("signum, said", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C (SIGINT)")])
def test_a_signalled_rank_marks_its_run_folder(tmp_path, signum, said):
    """A rank's watchdog on SIGTERM before training (nothing to save) or on Ctrl-C: one line naming
    it, exit 128 + the signal, and a stop marker for its peers in SAVE_DIR (created if the run had
    saved nothing yet), nothing in the temporary folder. The next run's watchdog clears the marks
    of processes that are gone, not those of live ones."""
    save_dir, temp = tmp_path / "run", tmp_path / "tmp"
    temp.mkdir()
    code = textwrap.dedent(f"""
        import time
        from ds_mtraining.training.watchdog import Watchdog
        Watchdog({str(save_dir)!r}, rank=0).start()
        print("watching", flush=True)
        time.sleep(60)
    """)
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment(TMPDIR=str(temp)))
    assert rank.stdout.readline() == "watching\n"
    rank.send_signal(signum)
    _, err = rank.communicate(timeout=30)
    assert rank.returncode == 128 + signum
    assert err.splitlines() == [f"ds_mtraining.train: stopped by {said} at step 0; no checkpoint in "
                                f"{save_dir.resolve()} yet"]
    marker = launcher_guard.stop_marker(save_dir, rank.pid)
    assert list(save_dir.iterdir()) == [marker] and not any(temp.iterdir())

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        launcher_guard.mark_stopped(save_dir, alive.pid)  # a live peer's: it may still be read
        launcher_guard.clear_stop_markers(save_dir)
        assert list(save_dir.iterdir()) == [launcher_guard.stop_marker(save_dir, alive.pid)]
    finally:
        alive.kill()
        alive.wait()



def test_a_preempted_rank_saves_though_the_signal_took_its_launcher(preempted):
    """SIGTERM to the launcher and its rank at once, as a scheduler sends it (DeepSpeed's
    single-node runner dies of it at once): the rank's watchdog, in the training loop, lets it
    finish its step and save instead of stopping for the gone launcher, and its guard does not
    kill it meanwhile: the rank says it saved and exits 128 + 15 by itself after the guard's grace."""
    preempted["thread"].join(60)
    launcher, rank_pid, folder = preempted["launcher"], preempted["rank"], preempted["folder"]
    assert preempted.get("watching") and launcher.wait(timeout=10) == -signal.SIGTERM
    while launcher_guard.process_stat(rank_pid) is not None and \
            time.monotonic() < preempted["signalled"] + launcher_guard.GRACE_S + 30:
        time.sleep(0.1)
    err = (folder / "err.txt").read_text()
    assert launcher_guard.process_stat(rank_pid) is None, "the preempted rank never stopped"
    assert (folder / "saved").exists(), err  # neither its watchdog nor its guard stopped it first
    assert err.splitlines() == [f"ds_mtraining.train: stopped by SIGTERM after finishing step 0: saved it in 1.00 s; "
                                f"no checkpoint in {(folder / 'run').resolve()} yet"]


def test_the_ranks_of_a_launcher_are_known_from_their_environment():
    """Before any process group exists, a rank knows its peers on the node: the launcher's
    children, by the rank variable in each one's environment (DeepSpeed's launch.py sets RANK)."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, subprocess, sys, time
        ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  env=dict(os.environ, RANK=str(r))) for r in (0, 1)]
        print(*(p.pid for p in ranks), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert launcher_guard.sibling_ranks(launcher.pid) == {0: pids[0], 1: pids[1]}
    finally:
        for pid in pids:
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)
        launcher.kill()
        launcher.wait()
