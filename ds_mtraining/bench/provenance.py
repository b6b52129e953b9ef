"""Which code a benchmark measured: every benchmark's JSON carries ``commit`` and ``dirty`` from
:func:`provenance`, so a number can be traced to the code that produced it."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

COMMIT_VARIABLE = "DS_MTRAINING_COMMIT"
DIRTY_SUFFIX = "-dirty"  # as `git describe --dirty` marks a tree with changes
ROOT = Path(__file__).resolve().parents[2]  # the checkout holding ds_mtraining/ (a clone, an editable install)


def provenance() -> dict:
    """``{"commit": sha, "dirty": bool}`` of the code this process runs.

    ``DS_MTRAINING_COMMIT=<sha>`` (all 40 digits) names the commit where the checkout's own git
    history is not the code measured (a copy of a working tree sent to another machine): ``dirty``
    is then false, or true when the value ends in ``-dirty`` (``<sha>-dirty``: the copy had changes
    on top of sha). Otherwise ``git rev-parse HEAD`` of the checkout holding this package, and
    whether ``git status --porcelain`` lists anything there (an untracked file counts: it may be
    code the run imported). Both are None where the package is in no checkout of its own (installed
    from a wheel)."""
    given = os.environ.get(COMMIT_VARIABLE)
    if given:
        commit = given.removesuffix(DIRTY_SUFFIX).lower()
        # all 40 digits: a short sha can grow ambiguous, and the copy has no git history to expand it
        if not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise ValueError(f"{COMMIT_VARIABLE}={given!r} must be a commit's full sha (40 hex digits: git rev-parse "
                             f"HEAD), followed by '{DIRTY_SUFFIX}' where the tree had changes on top of it")
        return {"commit": commit, "dirty": given.endswith(DIRTY_SUFFIX)}
    try:
        top, commit = _git("rev-parse", "--show-toplevel", "HEAD").splitlines()
        if Path(top).resolve() != ROOT:  # an installed package inside some other repository
            return {"commit": None, "dirty": None}
        return {"commit": commit, "dirty": bool(_git("status", "--porcelain").strip())}
    except (OSError, subprocess.SubprocessError, ValueError):  # no git, or not a checkout
        return {"commit": None, "dirty": None}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True,
                          timeout=30).stdout
