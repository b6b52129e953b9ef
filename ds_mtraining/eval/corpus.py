"""``python -m ds_mtraining.eval.corpus``: a corpus of real long documents for quality studies,
split into training and held-out parquet files (a ``text`` and a ``source`` column).

Sources, all offline and written by nobody on this project:

* ``--stdlib``: the running interpreter's standard library ``.py`` files (code, docstrings and
  comments), as :func:`ds_mtraining.data.stdlib_documents` reads them;
* ``--code DIR`` (repeatable): the ``.py`` files under DIR, e.g. an installed package's source
  (``--code "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')"``: about 46 MB),
  a corpus large enough for a study's training not to see a window twice on a machine with nothing
  else to read;
* ``--docs DIR`` (repeatable): the text files under DIR (``.rst``, ``.txt``, ``.md``, each also
  gzipped), e.g. the Linux kernel's documentation that Debian ships::

      apt-get download linux-doc-6.1 && dpkg -x linux-doc-6.1_*.deb linux-doc
      python -m ds_mtraining.eval.corpus --stdlib \\
          --docs linux-doc/usr/share/doc/linux-doc-6.1/Documentation --exclude translations \\
          --out data/quality

Files of one source are joined in sorted path order into documents of at least
``--document_chars`` characters (neighbouring files: one subsystem's documents, one package's
modules), so a document has real long-range structure. Whole documents go to the held-out split
with probability ``--heldout`` (seeded), so no held-out text is ever trained on. Training reads
``OUT/train.parquet`` (``"data": {"files": ["OUT/train.parquet"]}``), evaluation
``--data OUT/heldout.parquet``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from ..data import DEFAULT_DOCUMENT_CHARS, join_files, stdlib_documents
from ..record import write_json

TEXT_SUFFIXES = (".rst", ".txt", ".md")
CODE_SUFFIXES = (".py",)


def _read(path: Path) -> str:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


def text_files(root: Path, exclude=(), suffixes=TEXT_SUFFIXES) -> list[Path]:
    """The files under ``root`` named ``*<suffix>`` (plain or gzipped), skipping any path with a
    part in ``exclude``."""
    files = []
    for path in root.rglob("*"):
        name = path.name[:-3] if path.name.endswith(".gz") else path.name
        if path.is_file() and name.endswith(suffixes) and not set(path.relative_to(root).parts) & set(exclude):
            files.append(path)
    return files


def folder_documents(root: Path, document_chars: int, exclude=(), suffixes=TEXT_SUFFIXES,
                     option: str = "--docs") -> list[dict]:
    files = text_files(root, exclude, suffixes)
    if not files:
        raise ValueError(f"{option} {root}: no {'/'.join(suffixes)} files (plain or .gz) under it")
    return [{"text": text, "source": root.name}
            for text in join_files(root, files, document_chars, read=_read)]


def split_documents(documents: list[dict], heldout: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): each document is held out with probability ``heldout``; at least one
    document lands on each side."""
    if len(documents) < 2:
        raise ValueError(f"{len(documents)} document(s): a train/held-out split needs at least 2; "
                         f"lower --document_chars or add sources")
    chosen = np.random.default_rng(seed).random(len(documents)) < heldout
    if not chosen.any():
        chosen[-1] = True
    if chosen.all():
        chosen[0] = False
    train = [d for d, c in zip(documents, chosen) if not c]
    held = [d for d, c in zip(documents, chosen) if c]
    return train, held


def build_corpus(out: Path, stdlib: bool, docs, exclude=(), document_chars: int = DEFAULT_DOCUMENT_CHARS,
                 heldout: float = 0.05, seed: int = 0, code=()) -> dict:
    """Writes ``out/train.parquet``, ``out/heldout.parquet`` and ``out/corpus.json`` (what went in);
    returns the latter's contents."""
    import datasets
    documents = stdlib_documents(document_chars) if stdlib else []
    for root in code:
        documents += folder_documents(Path(root), document_chars, exclude, CODE_SUFFIXES, "--code")
    for root in docs:
        documents += folder_documents(Path(root), document_chars, exclude)
    if not documents:
        raise ValueError("no source: give --stdlib, --code DIR and/or --docs DIR")
    train, held = split_documents(documents, heldout, seed)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"document_chars": document_chars, "heldout_fraction": heldout, "seed": seed,
               "exclude": list(exclude), "sources": sorted({d["source"] for d in documents})}
    for name, part in (("train", train), ("heldout", held)):
        datasets.Dataset.from_list(part).to_parquet(str(out / f"{name}.parquet"))
        summary[name] = {"documents": len(part), "chars": int(sum(len(d["text"]) for d in part))}
    write_json(out / "corpus.json", summary)
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ds_mtraining.eval.corpus", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--stdlib", action="store_true", help="include the standard library's .py files")
    parser.add_argument("--code", action="append", default=[], help="a folder of .py files (repeatable)")
    parser.add_argument("--docs", action="append", default=[], help="a folder of .rst/.txt/.md files (repeatable)")
    parser.add_argument("--exclude", action="append", default=[], help="skip paths with this folder name")
    parser.add_argument("--document_chars", type=int, default=DEFAULT_DOCUMENT_CHARS, help="characters per document")
    parser.add_argument("--heldout", type=float, default=0.05, help="share of documents held out")
    parser.add_argument("--seed", type=int, default=0, help="seeds the split")
    args = parser.parse_args(argv)
    if not 0.0 < args.heldout < 1.0:
        parser.error("--heldout must lie in (0, 1)")
    try:
        summary = build_corpus(Path(args.out), args.stdlib, args.docs, args.exclude, args.document_chars,
                               args.heldout, args.seed, args.code)
    except (ValueError, FileNotFoundError) as error:
        print(f"ds_mtraining.eval.corpus: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
