"""Configuration of the vertical-slash dynamic sparse pattern (the paper's Algorithm 1)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

SUPPORTED_BLOCK_SIZES = (64, 128)
# keys whose meaning changed: refused with the new key's name rather than silently reinterpreted
RENAMED_KEYS = {"max_slash": "max_slash_diagonals"}


@dataclass(frozen=True)
class SparseConfig:
    """How the vertical-slash pattern is estimated each step.

    Attributes:
        last_q: number of trailing queries scored against all keys to estimate the pattern.
        block_size: kernel granularity in tokens (64 or 128): each selected token diagonal is
            covered by the block diagonal(s) it crosses; in ring attention, the stripe width.
        p_vertical: top-p mass the selected key columns must reach, in (0, 1].
        p_slash: top-p mass the selected token diagonals must reach, in (0, 1].
        max_vertical: cap on vertical key columns per head (tokens).
        max_slash_diagonals: cap on slash diagonals per head, counted in token diagonals (the
            paper's unit; each marks one or two block diagonals).
        sink_tokens: leading key tokens always kept as vertical columns (attention sinks).
        local_blocks: block diagonals 0 .. local_blocks-1 always kept (>= 1, so no row is empty).
    """

    last_q: int = 64
    block_size: int = 128
    p_vertical: float = 0.9
    p_slash: float = 0.9
    max_vertical: int = 4096
    max_slash_diagonals: int = 4096
    sink_tokens: int = 4
    local_blocks: int = 1

    def __new__(cls, *args, **kwargs):
        for key in RENAMED_KEYS.keys() & kwargs.keys():
            _refuse_renamed(key, cls.__name__)
        return super().__new__(cls)

    def __post_init__(self):
        for name in ("last_q", "max_vertical", "max_slash_diagonals"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SparseConfig.{name} must be a positive int, got {value!r}")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"SparseConfig.block_size={self.block_size!r} is unsupported; "
                f"use one of {SUPPORTED_BLOCK_SIZES}")
        for name in ("p_vertical", "p_slash"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ValueError(
                    f"SparseConfig.{name}={value!r} is out of range; top-p must be in (0, 1]")
        if not isinstance(self.sink_tokens, int) or self.sink_tokens < 0:
            raise ValueError(f"SparseConfig.sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if not isinstance(self.local_blocks, int) or self.local_blocks < 1:
            raise ValueError(
                f"SparseConfig.local_blocks must be an int >= 1 (the diagonal block keeps every "
                f"row non-empty), got {self.local_blocks!r}")

    @classmethod
    def from_dict(cls, values: dict, where: str = "sparse") -> "SparseConfig":
        """Builds a config from a JSON-like dict, naming unknown keys instead of ignoring them."""
        for key in RENAMED_KEYS:
            if key in values:
                _refuse_renamed(key, where)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in '{where}'; valid keys are {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


def _refuse_renamed(key: str, where: str):
    raise ValueError(
        f"'{key}' in '{where}' is no longer accepted (it capped block diagonals); use "
        f"'{RENAMED_KEYS[key]}', the cap in token diagonals (e.g. 4096)")


def slash_cap_for_blocks(blocks: int) -> int:
    """``max_slash_diagonals`` for about ``blocks`` block diagonals where the estimator's top-p
    runs to the cap (nearly uniform attention, e.g. random weights): the cap counts token
    diagonals, and scattered ones mark one or two block diagonals each."""
    return max(1, blocks // 2)
