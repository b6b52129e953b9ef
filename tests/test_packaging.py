"""What the wheel installs: the library, not the lab. The one-off kernel probes live in
``benchmarks/probes/`` (scripts run from a checkout), outside every package ``setup.py`` finds.
(A wheel build is left to ``pip wheel --no-deps -w DIR .`` by hand: this checks the source tree
and the packaging rule it builds from.)"""
from setuptools import find_packages

from helpers import REPO


def test_no_probe_in_the_package():
    assert not (REPO / "ds_mtraining" / "bench" / "probes").exists()
    assert sorted(p.name for p in (REPO / "benchmarks" / "probes").glob("*.py")) == [
        "copy_onset.py", "copy_probe.py", "dq_reduction_probe.py", "ncu_flex_case.py", "power_probe.py",
        "query_kernel_probe.py"]
    assert not any((REPO / folder / "__init__.py").exists() for folder in ("benchmarks", "benchmarks/probes"))
    setup = (REPO / "setup.py").read_text()
    assert 'find_packages(include=["ds_mtraining", "ds_mtraining.*"])' in setup  # the rule checked below
    packages = find_packages(str(REPO), include=["ds_mtraining", "ds_mtraining.*"])
    assert "ds_mtraining.bench" in packages
    assert [p for p in packages if "probe" in p or p.startswith("benchmarks")] == []
