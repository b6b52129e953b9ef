"""The docs and the committed results stay what a reader can trust: short README and RESULTS, every
result file current, named by date and cited, every JSON naming the commit it measured, every
README link to RESULTS landing on a row, and no doc about how the work was organised."""
import json
import re
import subprocess

from helpers import REPO

RESULTS_DIR = REPO / "benchmarks" / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# <study>_<device>_<yyyy-mm-dd>: kernel_documents_h200_2026-12-02.json, quality_curves_h200x2_2026-12-01.png
RESULT_NAME = re.compile(r"[a-z0-9]+(?:_[a-z0-9]+)*_(?:cpu|[a-z]+\d+(?:x\d+)?)_\d{4}-\d{2}-\d{2}\.(?:json|png)")


def tracked_text(*patterns: str) -> dict:
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    files = {}
    for name in names:
        try:
            files[name] = (REPO / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError):  # binary, or deleted in the work tree
            pass
    return files


def test_readme_and_results_are_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
    assert len((REPO / "docs" / "RESULTS.md").read_text().splitlines()) <= 200


def test_results_are_few_dated_cited_and_name_their_commit():
    files = sorted(p.name for p in RESULTS_DIR.iterdir())
    assert len(files) <= 48  # one file per study
    assert [f for f in files if not RESULT_NAME.fullmatch(f)] == []
    sources = tracked_text("README.md", "docs", "scripts", "tests", "ds_mtraining")
    citing = "\n".join(text for name, text in sources.items() if name != "tests/test_docs.py")  # its examples
    assert [f for f in files if f not in citing] == [], "files in benchmarks/results/ that nothing names"
    for name in files:
        if name.endswith(".json"):
            record = json.loads((RESULTS_DIR / name).read_text())
            assert re.fullmatch(r"[0-9a-f]{40}", record["commit"] or ""), name
            assert record["dirty"] in (True, False, None), name


def test_docs_cite_only_results_that_exist():
    for doc in DOCS:
        cited = set(re.findall(r"[\w.-]+_\d{4}-\d{2}-\d{2}\.(?:json|png)", doc.read_text()))
        assert [c for c in cited if not (RESULTS_DIR / c).is_file()] == [], doc.name


def test_links_to_results_land_on_rows():
    results = (REPO / "docs" / "RESULTS.md").read_text()
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', results))
    anchors |= {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", results, re.M)}
    readme = re.findall(r"\(docs/RESULTS\.md#([\w-]+)\)", (REPO / "README.md").read_text())
    assert len(readme) >= 5
    for doc in DOCS:
        links = re.findall(r"RESULTS\.md#([\w-]+)\)", doc.read_text())
        assert [link for link in links if link not in anchors] == [], doc.name


def test_no_doc_tells_how_the_work_was_organised():
    organised = re.compile(r"\bissues? ?#?\d+|\bissue's\b|(?<![\w-])device calls?\b|\blent\b|\blending\b|\bsessions?\b",
                           re.I)
    for doc in DOCS:
        assert organised.findall(doc.read_text()) == [], doc.name


def test_nothing_points_outside_the_repository():
    outside = "/".join(("..", "shared"))  # spelled in pieces, so that this file does not name it
    assert [name for name, text in tracked_text().items() if outside in text] == []
