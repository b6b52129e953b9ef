"""The suite leaves the machine as it found it. A slice of it, one test of each kind that once
wrote outside its temporary folders (a datasets cache entry per data file read, the ops' build
log, a rank's stop marker), runs as the README's command runs it, but with a home and a temporary
folder of its own: afterwards neither holds a file (pytest's own folder goes elsewhere,
``--basetemp``)."""
import os
import site
import subprocess
import sys

from helpers import REPO

from ds_mtraining_op_builder import extension_root

SLICE = ["tests/test_data.py::test_local_files_and_saved_dataset_give_the_same_stream",
         "tests/test_attention.py::test_running_accumulators_are_checked",
         "tests/test_launcher_guard.py::test_a_signalled_rank_marks_its_run_folder[15-SIGTERM]"]


def test_a_slice_of_the_suite_leaves_no_file_behind(tmp_path):
    home, temp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    temp.mkdir()
    # where the caches would go: the fresh home (this session's own datasets cache is not passed on)
    env = {name: value for name, value in os.environ.items()
           if name not in ("HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), TMPDIR=str(temp), OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=extension_root(),  # the machine's compiled ops, reused: not a leftover
               PYTHONUSERBASE=site.getuserbase())  # packages installed with --user stay importable
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "basetemp"), *SLICE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and f"{len(SLICE)} passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    left = sorted(str(path.relative_to(tmp_path)) for folder in (home, temp) for path in folder.rglob("*")
                  if not path.is_dir())
    assert left == [], left
