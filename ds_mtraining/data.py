"""Long-document training data: load (offline), tokenize, pack, shift, stripe per rank.

Sources (the ``mtraining.data`` section of the DeepSpeed JSON, see :func:`load_documents`):

* ``{"source": "stdlib"}`` (default): the Python standard library's own ``.py`` files of the
  running interpreter, read in sorted order and concatenated into long documents; real text that
  needs no download and that nobody on this project wrote.
  ``"document_chars"`` (default 2**18) sets the document length, ``"max_documents"`` keeps only
  the first documents (and reads only their files).
* ``{"files": ["a.jsonl", "b.parquet", ...], "text_field": "text"}``: local json/jsonl, parquet,
  arrow or csv files, read by ``datasets`` (format from the extension, or ``"format"``).
* ``{"saved_dataset": "dir", "split": "train"}``: a dataset saved with ``save_to_disk``
  (e.g. a ProLong-style long-document mix prepared elsewhere).
* ``{"source": "random"}``: uniformly random token ids over the model's whole vocabulary
  (``vocab_size`` from the model config, or ``"vocab_size"`` here), each sample one document,
  drawn from a generator seeded (seed, sample index): throughput benchmarks at any length with
  the real embedding and LM-head sizes, nothing read from disk (:class:`RandomSequences`;
  ``"samples"``, default 1024, is the size of one epoch).
* any source: ``"passkey_fraction"`` (default 0) turns that share of the samples into passkey
  retrieval samples (:func:`ds_mtraining.passkey.passkey_training_sample`: a random key at a
  random depth of the sample's own text, the question and the key at the end), chosen per sample
  index and epoch with a seeded generator, so a resumed run sees the same samples and a window
  seen again in a later epoch holds a new key (not one to learn by heart). ``"passkey_questions"``
  (default 1) asks for the key that many times per sample (more retrieval examples per step).
  ``"task_fractions"`` (default none), e.g. ``{"multikey": 0.25, "multivalue": 0.25, "vartrack":
  0.25}``, turns those shares of the samples into the RULER-style tasks of
  :mod:`ds_mtraining.ruler` in the same way (their answer at the end); with ``passkey_fraction``
  they sum to at most 1, and a sample is one task or none (one seeded draw per sample and
  epoch). ``"task_questions"`` (default 1) is their ``passkey_questions``: that many questions a
  sample, each answered (a model learns retrieval from many answers a sample: a dense stage before
  a long one; keep both at 1 when training sparse, docs/CONFIG.md says why).

Tokenizers: ``"bytes"`` (default), :class:`ByteTokenizer` (UTF-8 bytes 0..255 plus an end-of-
document token 256, implemented here, nothing to download), or the path of a local tokenizer
directory loaded with ``transformers.AutoTokenizer`` (``local_files_only``).

Packing: documents, each followed by the end-of-document token, form one token stream; sample i
is the window ``stream[i L : i L + L + 1]``: input ids are its first L tokens and labels its last L
(the shift happens here, on the global sequence, before striping). Sample order is a permutation
per epoch seeded by (seed, epoch), so the data position (micro-batches consumed) is all that a
checkpoint needs to resume the same stream.
"""
from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .layout import ContiguousLayout, StripedLayout

DEFAULT_DOCUMENT_CHARS = 1 << 18
DEFAULT_RANDOM_SAMPLES = 1024
SOURCES = ("stdlib", "random")
FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow",
                ".csv": "csv"}


class DataConfigError(ValueError):
    """A data setting that cannot work (raised before training starts)."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus ``eos_token_id`` = 256 between documents."""

    eos_token_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer loaded from a local directory (never downloaded)."""

    def __init__(self, path: str, key: str = "mtraining.tokenizer"):
        from transformers import AutoTokenizer
        if not Path(path).is_dir():
            raise DataConfigError(f"{key}={path!r} is neither 'bytes' nor an existing tokenizer directory; "
                                  f"use 'bytes' or the local directory of a saved tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self.tokenizer.eos_token_id is None:
            raise DataConfigError(f"{key}={path!r}: the tokenizer has no eos token to separate documents")
        self.eos_token_id = self.tokenizer.eos_token_id
        self.vocab_size = len(self.tokenizer)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def load_tokenizer(spec: str = "bytes", key: str = "mtraining.tokenizer"):
    """``"bytes"`` or a local tokenizer directory."""
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec, key)


# ----------------------------------------------------------------------------- documents
def stdlib_documents(document_chars: int = DEFAULT_DOCUMENT_CHARS,
                     max_documents: int | None = None) -> list[dict]:
    """The interpreter's standard library ``.py`` files (sorted, site-packages excluded), joined
    into documents of at least ``document_chars`` characters, each file under a path header.

    ``max_documents``: return only the first ``max_documents`` documents of that list (the same
    texts), reading no file beyond them. Results are cached per process (the full corpus is
    ~30 MB and takes seconds to read); each call returns new dicts."""
    return [{"text": text, "source": source}
            for text, source in _stdlib_documents(document_chars, max_documents)]


@functools.lru_cache(maxsize=4)
def _stdlib_documents(document_chars: int, max_documents: int | None) -> tuple:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, names in os.walk(root):  # not into site-packages (large)
        subdirectories[:] = [d for d in subdirectories if d != "site-packages"]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    if not files:
        raise DataConfigError(f"no .py files under the standard library directory {root}; "
                              f"set mtraining.data.files to your own corpus")
    if max_documents is not None and max_documents < 1:
        raise DataConfigError(f"max_documents={max_documents} must be a positive integer")
    return tuple((text, str(root)) for text in join_files(root, files, document_chars, max_documents))


def join_files(root: Path, files, document_chars: int, max_documents: int | None = None,
               read=lambda path: path.read_text(encoding="utf-8", errors="replace")) -> list[str]:
    """The ``files`` (under ``root``), in sorted order, joined into documents of at least
    ``document_chars`` characters, each file under a ``# relative/path`` header line; at most
    ``max_documents`` documents (no file beyond them is read)."""
    documents, parts, size = [], [], 0
    for path in sorted(files):
        text = f"# {path.relative_to(root)}\n" + read(path)
        parts.append(text)
        size += len(text)
        if size >= document_chars:
            documents.append("\n".join(parts))
            parts, size = [], 0
            if len(documents) == max_documents:
                return documents
    if parts:
        documents.append("\n".join(parts))
    return documents


def check_data_spec(spec: dict | None, key: str = "mtraining.data") -> dict:
    """Validates a data spec without reading the data (keys, one source, files exist, format);
    returns it with defaults filled in."""
    spec = dict(spec or {"source": "stdlib"})
    known = {"source", "files", "format", "text_field", "saved_dataset", "split", "document_chars",
             "max_documents", "passkey_fraction", "passkey_questions", "task_fractions", "task_questions", "samples",
             "vocab_size"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise DataConfigError(f"unknown key(s) {unknown} in '{key}'; valid keys are {sorted(known)}")
    chosen = [name for name in ("source", "files", "saved_dataset") if name in spec]
    if len(chosen) != 1:
        raise DataConfigError(f"'{key}' needs exactly one of 'source' (\"stdlib\" or \"random\"), 'files' or "
                              f"'saved_dataset', got {chosen or 'none'}")
    source = spec.get("source")
    if source is not None and source not in SOURCES:
        raise DataConfigError(f"{key}.source={source!r} is unknown; the built-in sources are {list(SOURCES)} "
                              f"(the stdlib corpus, random token ids; use 'files' or 'saved_dataset' for your data)")
    for name, owner in (("document_chars", "stdlib"), ("max_documents", "stdlib"), ("samples", "random"),
                        ("vocab_size", "random")):
        if name in spec and (type(spec[name]) is not int or spec[name] < 1 or source != owner):
            raise DataConfigError(f"{key}.{name}={spec[name]!r}: give a positive integer, with "
                                  f"\"source\": \"{owner}\" only")
    if source == "random" and spec.get("passkey_fraction", 0.0):
        raise DataConfigError(f"{key}.passkey_fraction: random token ids have no text to hide a passkey in; "
                              f"set it to 0 or use a text source")
    fraction = spec.get("passkey_fraction", 0.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise DataConfigError(f"{key}.passkey_fraction={fraction!r} must be a number in [0, 1] (the share "
                              f"of samples carrying a passkey retrieval task)")
    for name, what in (("passkey_questions", "a passkey sample asks for its key"),
                       ("task_questions", "a task_fractions sample asks one of its questions")):
        questions = spec.get(name, 1)
        if type(questions) is not int or questions < 1:
            raise DataConfigError(f"{key}.{name}={questions!r} must be a positive integer (how many times {what})")
    check_task_fractions(spec, key)
    if "files" in spec:
        files = [spec["files"]] if isinstance(spec["files"], str) else list(spec["files"])
        missing = [f for f in files if not Path(f).is_file()]
        if not files or missing:
            raise DataConfigError(f"{key}.files: file(s) not found: {missing or '(empty list)'}; "
                                  f"give existing local json/jsonl/parquet/arrow/csv paths")
        formats = {spec.get("format") or FILE_FORMATS.get(Path(f).suffix.lower()) for f in files}
        if None in formats or len(formats) != 1 or not formats <= set(FILE_FORMATS.values()):
            raise DataConfigError(f"{key}.files: cannot tell one format from the extensions of {files}; "
                                  f"set {key}.format to one of {sorted(set(FILE_FORMATS.values()))}")
        spec.update(files=files, format=formats.pop())
    if "saved_dataset" in spec and not Path(spec["saved_dataset"]).is_dir():
        raise DataConfigError(f"{key}.saved_dataset={spec['saved_dataset']!r} is not a directory; give "
                              f"the directory written by Dataset.save_to_disk")
    spec.setdefault("text_field", "text")
    return spec


def check_task_fractions(spec: dict, key: str = "mtraining.data"):
    """``task_fractions``: {task of ds_mtraining.ruler but passkey: share in [0, 1]}, summing with
    ``passkey_fraction`` to at most 1, on a text source."""
    fractions = spec.get("task_fractions")
    if fractions is None:
        return
    from .ruler import TASKS
    tasks = [t for t in TASKS if t != "passkey"]
    if not isinstance(fractions, dict) or sorted(set(fractions) - set(tasks)) or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in fractions.values()):
        raise DataConfigError(f"{key}.task_fractions={fractions!r} must map tasks of {tasks} to shares in [0, 1] "
                              f"(passkey has passkey_fraction)")
    if sum(fractions.values()) + spec.get("passkey_fraction", 0.0) > 1.0 + 1e-9:
        raise DataConfigError(f"{key}.task_fractions and passkey_fraction sum to "
                              f"{sum(fractions.values()) + spec.get('passkey_fraction', 0.0):g}, more than 1")
    if spec.get("source") == "random" and any(fractions.values()):
        raise DataConfigError(f"{key}.task_fractions: random token ids have no text to hide a task in; "
                              f"use a text source")


def folder_spec(folder: str, key: str = "--data") -> dict:
    """The data spec of a folder (``--data DIR``): a dataset saved with ``save_to_disk``, or the
    json/jsonl/parquet/arrow/csv files under it (recursively, sorted, one format)."""
    root = Path(folder)
    if any((root / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return {"saved_dataset": str(root)}
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in FILE_FORMATS
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
    except OSError as error:
        raise DataConfigError(f"{key} {folder}: cannot list the folder ({error}); check its permissions") from None
    if not files:
        raise DataConfigError(f"{key} {folder}: no {'/'.join(sorted(set(FILE_FORMATS.values())))} files "
                              f"(by extension: {', '.join(FILE_FORMATS)}) and no saved dataset in the "
                              f"folder; point --data at your documents")
    formats = sorted({FILE_FORMATS[p.suffix.lower()] for p in files})
    if len(formats) > 1:
        raise DataConfigError(f"{key} {folder}: the folder mixes formats {formats}; keep one format per "
                              f"folder or list the files in mtraining.data.files")
    return {"files": [str(p) for p in files]}


def _holds_nothing(path: Path) -> bool:
    """An empty or whitespace-only file (which the readers fail on with an unhelpful error)."""
    try:
        size = path.stat().st_size
        return size == 0 or (size < 4096 and not path.read_bytes().strip())
    except OSError:  # unreadable: the reader's own message says why
        return False


def load_documents(spec: dict | None, key: str = "mtraining.data"):
    """A ``datasets.Dataset`` with a ``text`` column from a data spec (see the module docstring)."""
    import datasets
    spec = check_data_spec(spec, key)
    text_field = spec["text_field"]
    if spec.get("source") == "random":
        raise DataConfigError(f"{key}: the random source has no documents; build its samples with "
                              f"ds_mtraining.data.RandomSequences")
    if "source" in spec:
        documents = stdlib_documents(spec.get("document_chars", DEFAULT_DOCUMENT_CHARS),
                                     spec.get("max_documents"))
        return datasets.Dataset.from_list(documents)
    empty = [f for f in spec.get("files", ()) if _holds_nothing(Path(f))]
    if empty:
        raise DataConfigError(f"{key}: empty file(s) {', '.join(empty)}: put documents in them or remove them")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(max(verbosity, datasets.logging.CRITICAL))  # a failure: our line only
    try:
        if "files" in spec:
            dataset = datasets.load_dataset(spec["format"], data_files=spec["files"], split="train")
        else:
            dataset = datasets.load_from_disk(spec["saved_dataset"])
    except Exception as error:  # noqa: BLE001 - any reader failure is the data's problem: one line
        where = spec.get("files") or spec["saved_dataset"]
        cause = error.__cause__ or error.__context__ or error
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        raise DataConfigError(f"{key}: cannot read {where} as {spec.get('format', 'a saved dataset')} "
                              f"({type(cause).__name__}: {first}); fix or remove the unreadable file(s)") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if isinstance(dataset, datasets.DatasetDict):
        split = spec.get("split", "train")
        if split not in dataset:
            raise DataConfigError(f"{key}.split={split!r} is not in {list(dataset)}")
        dataset = dataset[split]
    if text_field not in dataset.column_names:
        raise DataConfigError(f"{key}.text_field={text_field!r} is not a column of the data "
                              f"(columns: {dataset.column_names}); set {key}.text_field")
    where = spec.get("files") or spec["saved_dataset"]
    column = dataset.data.column(text_field)
    if column.null_count:
        raise DataConfigError(f"{key}: {column.null_count} document(s) of {where} have no text (null "
                              f"{text_field!r}); give them text or remove them")
    try:  # the json reader keeps bytes that are not UTF-8; tokenizing would fail on them later
        column.validate(full=True)
    except Exception as error:  # noqa: BLE001 - pyarrow's ArrowInvalid: one line
        raise DataConfigError(f"{key}: {where} holds text that is not UTF-8 ({str(error).strip()[:200]}); "
                              f"convert it, e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8") from None
    return dataset.rename_column(text_field, "text") if text_field != "text" else dataset


def tokenize_documents(documents, tokenizer):
    """Adds ``input_ids`` (each document followed by the end-of-document token) and ``length``."""
    def encode(batch):
        ids = [np.append(tokenizer.encode(text), tokenizer.eos_token_id).astype(np.int32)
               for text in batch["text"]]
        return {"input_ids": ids, "length": [len(x) for x in ids]}
    # arrow format, not "numpy": datasets' numpy formatter imports torchvision when it is installed
    # and breaks with some torchvision builds (seen on the GPU machine); arrow reads zero-copy anyway
    return documents.map(encode, batched=True, remove_columns=documents.column_names,
                         desc="tokenizing").with_format("arrow")


# ----------------------------------------------------------------------------- packing
class PackedSequences:
    """Fixed-length causal-LM samples cut from the concatenated token stream of the documents.

    ``self.sample(i, epoch)`` (``self[i]``: epoch 0) is ``(input_ids [L], labels [L])`` int64,
    labels shifted by one on the stream. With ``passkey_fraction`` > 0 (and the ``tokenizer``),
    sample i is a passkey sample made from its own window with probability ``passkey_fraction``,
    decided by a generator seeded (seed, i, epoch), asking ``passkey_questions`` times for its key;
    with ``task_fractions`` the same draw makes it a sample of one of :mod:`ds_mtraining.ruler`'s
    other tasks with those probabilities, asking ``task_questions`` times. The epoch is in the seed
    because a window seen again must not come with the same key: over several epochs of a small
    corpus a model learns each window's key by heart instead of retrieving it from the needle."""

    def __init__(self, tokenized, seq_len: int, passkey_fraction: float = 0.0, tokenizer=None,
                 seed: int = 0, passkey_questions: int = 1, task_fractions: dict | None = None,
                 task_questions: int = 1):
        self.documents = tokenized
        self.seq_len = seq_len
        from .ruler import TASKS  # the tasks in one fixed order: the draw's bounds do not follow the JSON's order
        self.task_fractions = {t: float((task_fractions or {})[t]) for t in TASKS if (task_fractions or {}).get(t)}
        if (passkey_fraction or self.task_fractions) and tokenizer is None:
            raise ValueError("passkey and task samples need the tokenizer (to encode the question and the key)")
        self.passkey_fraction, self.tokenizer, self.seed = passkey_fraction, tokenizer, seed
        self.passkey_questions, self.task_questions = passkey_questions, task_questions
        if passkey_fraction:
            from .passkey import passkey_fixed_tokens
            fixed = passkey_fixed_tokens(tokenizer, questions=passkey_questions)
            if fixed > seq_len:
                raise DataConfigError(f"a passkey sample's fixed text ({passkey_questions} question(s)) takes {fixed} "
                                      f"tokens, more than mtraining.seq_len={seq_len}; lower "
                                      f"mtraining.data.passkey_questions or raise seq_len")
        for task in self.task_fractions:
            from .ruler import task_fixed_tokens
            fixed = task_fixed_tokens(task, tokenizer, questions=task_questions)
            if fixed > seq_len:
                raise DataConfigError(f"a {task} sample's fixed text ({task_questions} question(s)) takes {fixed} "
                                      f"tokens, more than mtraining.seq_len={seq_len}; lower "
                                      f"mtraining.data.task_questions or raise seq_len")
        lengths = tokenized["length"].to_numpy().astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        self.total_tokens = int(self.starts[-1])
        if self.total_tokens < seq_len + 1:
            raise DataConfigError(f"the corpus holds {self.total_tokens} tokens, fewer than one sample of "
                                  f"mtraining.seq_len + 1 = {seq_len + 1}; add data or shorten seq_len")

    def __len__(self) -> int:
        return (self.total_tokens - 1) // self.seq_len

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start + length - 1`` of the stream."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces, position, doc = [], start, first
        while position < start + length:
            ids = self.documents[doc].column("input_ids")[0].values.to_numpy(zero_copy_only=False)
            offset = position - int(self.starts[doc])
            piece = ids[offset:offset + start + length - position]
            pieces.append(piece)
            position += len(piece)
            doc += 1
        return np.concatenate(pieces)

    def _task(self, i: int, epoch: int) -> tuple[str, np.random.Generator] | None:
        """(task, its generator) of sample i in ``epoch``, None when it carries none."""
        if not self.passkey_fraction and not self.task_fractions:
            return None
        rng = np.random.default_rng([self.seed, i, epoch, 0x9A55])
        draw = rng.random()
        if draw < self.passkey_fraction:
            return "passkey", rng
        bound = self.passkey_fraction
        for task, fraction in self.task_fractions.items():
            bound += fraction
            if draw < bound:
                return task, rng
        return None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(i)

    def sample(self, i: int, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        tokens = self.window(i * self.seq_len, self.seq_len + 1).astype(np.int64)
        chosen = self._task(i, epoch)
        if chosen is not None and chosen[0] == "passkey":
            from .passkey import passkey_training_sample
            tokens = passkey_training_sample(tokens, self.tokenizer, chosen[1], questions=self.passkey_questions)
        elif chosen is not None:
            from .ruler import task_training_sample
            tokens = task_training_sample(chosen[0], tokens, self.tokenizer, chosen[1], questions=self.task_questions)
        tokens = torch.from_numpy(tokens)
        return tokens[:-1], tokens[1:]

    def cu_seqlens(self, i: int, epoch: int = 0) -> torch.Tensor:
        """int64 [n + 1]: where the documents of sample i's input tokens begin, then L (a window
        may start inside a document: its first piece is a document of its own). A passkey or task
        sample is one document (its needle and question must see each other)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        start, end = i * self.seq_len, (i + 1) * self.seq_len
        inside = self.starts[(self.starts > start) & (self.starts < end)] - start
        if self._task(i, epoch) is not None:
            inside = inside[:0]
        return torch.from_numpy(np.concatenate([[0], inside, [self.seq_len]]).astype(np.int64))


class RandomSequences:
    """Samples of uniformly random token ids in ``[0, vocab_size)``, the same interface as
    :class:`PackedSequences`: ``self[i]`` is ``(input_ids [L], labels [L])`` int64, labels shifted by
    one on a window of L + 1 tokens drawn from a generator seeded (seed, i); each sample is one
    document. ``samples`` is the length of one epoch."""

    def __init__(self, seq_len: int, vocab_size: int, samples: int = DEFAULT_RANDOM_SAMPLES, seed: int = 0):
        self.seq_len, self.vocab_size, self.samples, self.seed = seq_len, vocab_size, samples, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(i)

    def sample(self, i: int, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i, the same in every epoch (the interface of :meth:`PackedSequences.sample`)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        generator = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, i]).generate_state(1)[0]))
        tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        return tokens[:-1], tokens[1:]

    def cu_seqlens(self, i: int, epoch: int = 0) -> torch.Tensor:
        return torch.tensor([0, self.seq_len], dtype=torch.int64)


def training_samples(spec: dict, seq_len: int, tokenizer, seed: int, vocab_size: int,
                     key: str = "mtraining.data"):
    """The samples of a run: :class:`RandomSequences` for ``{"source": "random"}`` (over
    ``vocab_size``, the model's, unless the spec gives one), else the documents of ``spec``
    tokenized and packed (:class:`PackedSequences`)."""
    spec = check_data_spec(spec, key)
    if spec.get("source") == "random":
        return RandomSequences(seq_len, spec.get("vocab_size", vocab_size),
                               spec.get("samples", DEFAULT_RANDOM_SAMPLES), seed)
    documents = load_documents(spec, key=key)
    return PackedSequences(tokenize_documents(documents, tokenizer), seq_len, spec.get("passkey_fraction", 0.0),
                           tokenizer, seed, spec.get("passkey_questions", 1), spec.get("task_fractions"),
                           spec.get("task_questions", 1))


# ----------------------------------------------------------------------------- per-rank batches
SHARD_LAYOUTS = {"striped": StripedLayout, "contiguous": ContiguousLayout}


@dataclass
class RankBatches:
    """Micro-batches for one rank: data-parallel replica ``data_rank`` of ``data_world`` reads its
    own samples; the ``sequence_world`` ranks of its sequence-parallel group read the same samples
    and each keeps its stripe (blocks r, r + W, ... of ``block_size`` tokens).

    ``batch(position)`` gives micro-batch number ``position`` (counting from 0 over the whole
    run, all epochs) as a dict of [B, S/W] int64 tensors: input_ids, labels, position_ids. With
    ``document_masking`` it also holds ``doc_start``, int32 [B, S] for the *whole* sequence
    (:mod:`ds_mtraining.documents`; every rank needs all of it), and the position ids restart at
    0 in each document (RoPE of packed documents); a batch whose samples are each one document
    (e.g. passkey samples) has nothing to mask and carries no ``doc_start``. ``layout``
    ``"contiguous"`` gives contiguous shards instead of stripes (:class:`ContiguousLayout`, for DeepSpeed-Ulysses).
    """

    samples: PackedSequences
    micro_batch_size: int
    data_rank: int = 0
    data_world: int = 1
    sequence_rank: int = 0
    sequence_world: int = 1
    block_size: int = 128
    seed: int = 0
    document_masking: bool = False
    layout_name: str = "striped"

    def __post_init__(self):
        if self.layout_name not in SHARD_LAYOUTS:
            raise ValueError(f"layout_name={self.layout_name!r}; use one of {list(SHARD_LAYOUTS)}")
        self.layout = SHARD_LAYOUTS[self.layout_name](self.sequence_world, self.block_size)
        self.layout.check(self.samples.seq_len)
        self.per_epoch = len(self.samples) // (self.micro_batch_size * self.data_world)
        if self.per_epoch < 1:
            raise DataConfigError(
                f"the corpus packs into {len(self.samples)} samples of {self.samples.seq_len} tokens, "
                f"fewer than one global micro-batch (micro batch {self.micro_batch_size} x "
                f"{self.data_world} data-parallel replicas); add data or shorten mtraining.seq_len")

    def epoch(self, position: int) -> int:
        """The epoch (pass over the samples) that micro-batch ``position`` belongs to."""
        return position // self.per_epoch

    def sample_ids(self, position: int) -> list[int]:
        epoch, within = self.epoch(position), position % self.per_epoch
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))
        first = (within * self.data_world + self.data_rank) * self.micro_batch_size
        return [int(i) for i in order[first:first + self.micro_batch_size]]

    def batch(self, position: int) -> dict:
        ids, epoch = self.sample_ids(position), self.epoch(position)
        pairs = [self.samples.sample(i, epoch) for i in ids]
        input_ids = torch.stack([p[0] for p in pairs])
        labels = torch.stack([p[1] for p in pairs])
        doc_start = None
        cu_seqlens = [self.samples.cu_seqlens(i, epoch) for i in ids] if self.document_masking else []
        if any(len(cu) > 2 for cu in cu_seqlens):  # a sample packs several documents: mask them
            from .documents import doc_start_from_cu_seqlens
            doc_start = doc_start_from_cu_seqlens(cu_seqlens, input_ids.shape[1], len(ids))
        return shard_batch(self.layout, self.sequence_rank, input_ids, labels, doc_start)


def shard_batch(layout, rank: int, input_ids: torch.Tensor, labels: torch.Tensor,
                doc_start: torch.Tensor | None = None) -> dict:
    """``rank``'s shard under ``layout`` of whole sequences ``input_ids`` and ``labels`` [B, S]
    (labels already shifted on the global sequence): a dict of [B, S/W] int64 input_ids, labels
    and position_ids (the global positions of its tokens). With ``doc_start`` ([B, S], several
    documents packed) the position ids restart at 0 in each document and ``doc_start`` rides along
    whole (every rank needs all of it); without, there is nothing to mask (the faster paths run)."""
    batch = {"input_ids": layout.shard(input_ids, rank), "labels": layout.shard(labels, rank)}
    if doc_start is not None:
        from .documents import document_positions
        batch["position_ids"] = layout.shard(document_positions(doc_start), rank)
        batch["doc_start"] = doc_start
    else:
        positions = layout.positions(input_ids.shape[1], rank, device=input_ids.device)
        batch["position_ids"] = positions.expand(input_ids.shape[0], -1).contiguous()
    return batch


def datasets_offline():
    """Makes ``datasets``/``huggingface_hub`` work without a network (local files only)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
