"""A Hugging Face model directory as a few files small enough to leave a GPU machine and come back.

A device call brings back at most 16 MiB a file and 64 MiB a call, and carries at most 64 MiB with
the working tree, so a study that spans two stays on a machine that starts bare each time (the
long quality study: dense stages in one, the arms from their model in the next) moves its model as
a pack::

    pack_model(hf_dir, dest, bf16=True)   # dest/manifest.json + dest/model.tar.part-00, -01, ...
    unpack_model(dest, hf_dir)            # all parts present, checksum checked -> hf_dir again

The pack is a tar of the directory split into parts of ``part_bytes``, with the SHA-256 of each
part and of the whole in ``manifest.json``. With ``bf16``, float32 tensors travel in bfloat16 and
come back as float32: half the bytes, and nothing lost for a bf16 DeepSpeed run, which casts the
module to bf16 and makes its fp32 master weights from those (ZeRO's optimizer copies its bit16
partitions). Without it the weights travel bit for bit."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

from ..record import provenance, write_json

MANIFEST = "manifest.json"
PART_PREFIX = "model.tar.part-"
PART_BYTES = 15 << 20  # under the 16 MiB a file that comes back from a device call may have
DTYPES_KEY = "ds_mtraining_packed_dtypes"  # a packed safetensors file's metadata: {tensor: its own dtype}


def pack_model(hf_dir: str | Path, dest: str | Path, bf16: bool = False, part_bytes: int = PART_BYTES) -> list[Path]:
    """Writes ``hf_dir`` as parts and a manifest into ``dest`` (emptied first); returns the files
    written, the manifest last."""
    hf_dir, dest = Path(hf_dir), Path(dest)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} is no Hugging Face model directory (no config.json)")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for file in sorted(p for p in hf_dir.iterdir() if p.is_file()):
            data = _bf16_safetensors(file) if bf16 and file.suffix == ".safetensors" else file.read_bytes()
            info = tarfile.TarInfo(file.name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    whole = buffer.getvalue()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    parts = []
    for i, start in enumerate(range(0, len(whole), part_bytes)):
        part = dest / f"{PART_PREFIX}{i:02d}"
        part.write_bytes(whole[start:start + part_bytes])
        parts.append(part)
    manifest = {**provenance(), "source": str(hf_dir.resolve()), "bf16": bf16, "bytes": len(whole),
                "sha256": _sha256(whole), "parts": {p.name: _sha256(p.read_bytes()) for p in parts}}
    write_json(dest / MANIFEST, manifest)
    return [*parts, dest / MANIFEST]


def missing_parts(src: str | Path) -> list[str]:
    """The parts that ``src``'s manifest names and ``src`` lacks (all of them without a manifest)."""
    src = Path(src)
    if not (src / MANIFEST).is_file():
        return [MANIFEST]
    return [name for name in json.loads((src / MANIFEST).read_text())["parts"] if not (src / name).is_file()]


def unpack_model(src: str | Path, hf_dir: str | Path) -> Path:
    """The model directory packed in ``src`` written to ``hf_dir`` (replaced whole, or not at
    all); a missing or damaged part raises, naming it."""
    src, hf_dir = Path(src), Path(hf_dir)
    missing = missing_parts(src)
    if missing:
        raise FileNotFoundError(f"the model pack in {src} lacks {', '.join(missing)}: copy every file that "
                                f"packed it made (scripts/quality_model.sh send) into it")
    manifest = json.loads((src / MANIFEST).read_text())
    chunks = []
    for name, digest in manifest["parts"].items():
        data = (src / name).read_bytes()
        if _sha256(data) != digest:
            raise ValueError(f"{src / name} is damaged (its SHA-256 is not the manifest's): copy it again")
        chunks.append(data)
    whole = b"".join(chunks)
    if _sha256(whole) != manifest["sha256"]:
        raise ValueError(f"the parts in {src} do not join into the packed model (SHA-256 differs)")
    staging = hf_dir.with_name(hf_dir.name + ".unpacking")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(whole), mode="r") as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            if member.name.endswith(".safetensors") and manifest["bf16"]:
                data = _restored_safetensors(data)
            (staging / Path(member.name).name).write_bytes(data)
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    staging.rename(hf_dir)
    return hf_dir


def _bf16_safetensors(file: Path) -> bytes:
    """A safetensors file's bytes with its float32 tensors in bfloat16 (their dtypes in the metadata)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save

    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    dtypes = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}
    packed = {name: t.to(torch.bfloat16) if t.dtype == torch.float32 else t for name, t in tensors.items()}
    return save(packed, metadata={**metadata, DTYPES_KEY: json.dumps(dtypes)})


def _restored_safetensors(data: bytes) -> bytes:
    """Inverse of _bf16_safetensors: each tensor back in its own dtype, the metadata as it was."""
    import torch
    from safetensors.torch import load, save

    header_len = int.from_bytes(data[:8], "little")  # safetensors: an 8-byte length, then the JSON header
    metadata = dict(json.loads(data[8:8 + header_len]).get("__metadata__", {}))
    dtypes = json.loads(metadata.pop(DTYPES_KEY))
    tensors = {name: t.to(getattr(torch, dtypes[name])) for name, t in load(data).items()}
    return save(tensors, metadata=metadata or None)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
