"""The ``mtraining`` section of the DeepSpeed JSON, validated before any process group exists:
a bad value is one :class:`ConfigError` naming its key and the fix (see :mod:`ds_mtraining.train`)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..config import SUPPORTED_BLOCK_SIZES, SparseConfig
from ..data import DataConfigError, check_data_spec, folder_spec, load_tokenizer
from ..dense_backend import DenseBackendError, check_dense_backend
from ..distributed import RING_KINDS, ParallelConfigError, check_parallel_sizes
from ..layout import check_divisible
from . import MTRAINING_KEY, ConfigError
from .memory import MemorySettings, parse_memory
from .model import PRESETS, check_liger_setting, model_config

DEFAULT_STALL_TIMEOUT_S = 600  # torch's NCCL default; above a 1M-token step and a 3B checkpoint save
ULYSSES = "ulysses"  # dense HF attention (SDPA or FA4: dense_backend) under DeepSpeed-Ulysses sequence parallelism
# keys of the section that are no RunConfig field, with their docs/CONFIG.md text
INPUT_KEYS = {"stripe_block": "the stripe width and kernel block, 64 or 128: sets `sparse.block_size` (give one)"}


@dataclass
class RunConfig:
    """The validated ``mtraining`` section. Built only by :func:`parse_run_config`, which is where
    every default is (a key left out); docs/CONFIG.md shows them, generated with these texts by
    ``python -m ds_mtraining.tools.config_doc``.

    Attributes:
        seq_len: tokens per training sequence, the whole sequence over the sequence-parallel group;
            a multiple of sequence_parallel_size x the stripe block.
        sequence_parallel_size: ranks that share one sequence (one ring); the world size divided by
            it is the data-parallel size. Left out: the world size (one ring over every rank).
        ring: `flat`, `hierarchical` (an inner ring inside each node, an outer ring across nodes)
            or `auto` (hierarchical where a sequence-parallel group spans nodes).
        sparse: the vertical-slash estimator's budgets and the kernel block (`SparseConfig`).
        model: a preset (`tiny-qwen2`; `qwen2.5-3b` and `llama-3.1-8b`: real shapes, random weights),
            a local model directory (`--model DIR`), or `{"name_or_path": ..., "config_overrides":
            {...}}`: fields of the model's config; of a model with weights only the context's
            (`rope_theta`, `rope_scaling`, `rope_parameters`, `max_position_embeddings`), to continue
            its training at a longer context.
        tokenizer: `bytes` (UTF-8 bytes and an end-of-document token), `model` (the model
            directory's own) or a local tokenizer directory.
        data: where the documents come from: `{"source": "stdlib"}` (the Python standard library's
            sources), `{"source": "random"}` (random token ids over the model's vocabulary),
            `{"files": [...]}` or `{"saved_dataset": DIR}` (or `--data DIR`); every text source also
            takes `passkey_fraction`, `passkey_questions`, `task_fractions` and `task_questions` (the
            RULER-style tasks of ds_mtraining/ruler.py; the module docstring of ds_mtraining/data.py
            lists every key).
        loss_chunk_tokens: rows per chunk of the chunked torch loss (the CPU path; GPUs without liger).
        gradient_checkpointing: activation checkpointing of every decoder layer.
        attention: `sparse` (MTraining), `dense` (a full index through the same ring: the baseline),
            `static` (sinks and a local window, set in `static`) or `ulysses` (the model's dense SDPA
            under DeepSpeed-Ulysses; W must divide the query heads, and divide the key/value heads or
            be a multiple of them).
        static: with `attention: "static"`, the pattern: `{"density": 0.1, "sink_tokens": 4}` (the
            nearest achievable density) or `{"window_tokens": N}`.
        document_masking: packed documents attend only within themselves. Left out: on where the
            loader packs documents (every data source but `random`) and the attention can mask them
            (every attention but `ulysses`).
        liger: `"auto"`: liger-kernel's fused RMSNorm, RoPE, SwiGLU and linear cross-entropy replace
            the HF model's on GPUs where liger-kernel is installed (Qwen2 and Llama models); `true`:
            their absence is an error; `false`: off. The run's second line says which.
        keep_attention_output: with gradient_checkpointing, each layer's attention output and LSE
            are kept from the forward (B x S/W x H x D elements per layer), so the recomputed forward
            runs no attention and no ring.
        memory: the long-sequence memory tools (`MemorySettings`); the run's first line says what
            each one chose and why.
        dense_backend: the kernel of the dense baselines, `attention: "dense"` on one GPU without
            documents and `ulysses`: `sdpa` (torch's SDPA with its own dispatch: cuDNN's attention
            kernel on an H200), `fa4` (FlashAttention-4, `pip install flash-attn-4`; Hopper and
            Blackwell; where it cannot run, one line says why) or `auto` (a fixed rule by GPU
            architecture: FA4 on Hopper, where on an H200 its causal fwd+bwd ran 1.9x SDPA's flash
            backend and a training step's attention 1.2x SDPA's cuDNN kernel, SDPA elsewhere and
            wherever FA4 cannot run; the run's first lines name the kernel and why). Other modes
            ignore it.
        stall_timeout_s: seconds a rank may make no progress (a phase of a step: data, forward,
            backward, optimizer step, checkpoint save) before the job stops with one line naming
            it, its host, the step and where it was (its Python stack in the log); a collective on
            any of the run's process groups times out a minute later. Raise it above the longest
            phase (a slow disk's checkpoint save); 0 turns it off (the groups: DeepSpeed's timeout).
        max_nonfinite_steps: optimizer steps in a row with a non-finite loss (or, in bf16 and fp32,
            a step DeepSpeed skipped for a non-finite gradient norm) that the run continues
            through; one more stops it, with no checkpoint after the first of them. In fp16 the
            skips of DeepSpeed's loss scaler are its own (it stops at its minimum scale).
    """

    seq_len: int
    sequence_parallel_size: int
    ring: str
    sparse: SparseConfig
    model: dict
    tokenizer: str
    data: dict
    loss_chunk_tokens: int
    gradient_checkpointing: bool
    attention: str
    static: dict | None
    document_masking: bool
    liger: str | bool
    keep_attention_output: bool
    memory: MemorySettings
    dense_backend: str
    stall_timeout_s: int | float
    max_nonfinite_steps: int

    def to_dict(self) -> dict:
        values = asdict(self)
        values["sparse"] = self.sparse.to_dict()
        return values


def _positive_int(section: dict, key: str, default=None) -> int:
    value = section.get(key, default)
    if value is None:
        raise ConfigError(f"{MTRAINING_KEY}.{key} is required (a positive integer)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{MTRAINING_KEY}.{key}={value!r} must be a positive integer")
    return value


def _model_spec(value) -> dict:
    spec = {"name_or_path": value} if isinstance(value, str) else dict(value or {})
    unknown = sorted(set(spec) - {"name_or_path", "config_overrides"})
    if unknown or "name_or_path" not in spec:
        raise ConfigError(f"{MTRAINING_KEY}.model must be a preset name {sorted(PRESETS)}, a local model "
                          f"directory, or {{'name_or_path': ..., 'config_overrides': {{...}}}}; got {value!r}")
    name = spec["name_or_path"]
    if name not in PRESETS and not Path(name).is_dir():
        raise ConfigError(f"{MTRAINING_KEY}.model={name!r} is neither a preset {sorted(PRESETS)} nor an "
                          f"existing local directory (config.json [+ weights]); models are never downloaded: "
                          f"pass a preset or a local path (--model)")
    return {"name_or_path": name, "config_overrides": dict(spec.get("config_overrides", {}))}


def check_model(spec: dict, vocab_size: int, device_type: str | None = None):
    """Heads/GQA/feature checks (with the CUDA kernels' for ``device_type`` ``"cuda"``) and the
    tokenizer's vocabulary against the model's."""
    from ds_mtraining.hf import check_model_config
    config = model_config(spec)
    try:
        check_model_config(config, f"{MTRAINING_KEY}.model ({spec['name_or_path']})", device_type)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if vocab_size > config.vocab_size:
        raise ConfigError(f"{MTRAINING_KEY}.tokenizer has {vocab_size} tokens but the model's vocab_size is "
                          f"{config.vocab_size}; use a matching tokenizer or override vocab_size")
    return config


# every key of the section: RunConfig's fields and the input-only keys (ds_mtraining.integration reads it too)
SECTION_KEYS = frozenset({f.name for f in fields(RunConfig)} | set(INPUT_KEYS))


def parse_run_config(section: dict, world_size: int) -> RunConfig:
    """Validates the ``mtraining`` section against a world of ``world_size`` ranks."""
    if not isinstance(section, dict):
        raise ConfigError(f"the DeepSpeed JSON needs a \"{MTRAINING_KEY}\" object, got {section!r}")
    unknown = sorted(set(section) - SECTION_KEYS)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in '{MTRAINING_KEY}'; valid keys are {sorted(SECTION_KEYS)}")
    sp = section.get("sequence_parallel_size", world_size)
    try:
        check_parallel_sizes(world_size, sp, key=f"{MTRAINING_KEY}.sequence_parallel_size")
    except ParallelConfigError as error:
        raise ConfigError(str(error)) from None
    ring = section.get("ring", "auto")
    if ring not in RING_KINDS:
        raise ConfigError(f"{MTRAINING_KEY}.ring={ring!r} is not a ring kind; use one of {list(RING_KINDS)}")
    sparse_values = dict(section.get("sparse", {}))
    if "stripe_block" in section:
        block = section["stripe_block"]
        if isinstance(block, bool) or block not in SUPPORTED_BLOCK_SIZES:
            raise ConfigError(f"{MTRAINING_KEY}.stripe_block={block!r} is unsupported; use one of "
                              f"{list(SUPPORTED_BLOCK_SIZES)} (the stripe width is the kernel block)")
        if "block_size" in sparse_values and sparse_values["block_size"] != block:
            raise ConfigError(f"{MTRAINING_KEY}.stripe_block={block} differs from {MTRAINING_KEY}.sparse."
                              f"block_size={sparse_values['block_size']}; the stripe is the kernel block: "
                              f"give one of them")
        sparse_values["block_size"] = block
    try:
        sparse = SparseConfig.from_dict(sparse_values, where=f"{MTRAINING_KEY}.sparse")
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{MTRAINING_KEY}.sparse: {error}") from None
    seq_len = _positive_int(section, "seq_len")
    try:
        check_divisible(seq_len, sp, sparse.block_size, what=f"{MTRAINING_KEY}.seq_len",
                        factors="sequence_parallel_size x stripe_block")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    checkpointing = _boolean(section, "gradient_checkpointing")
    liger = section.get("liger", "auto")
    check_liger_setting(liger)
    try:
        dense_backend = check_dense_backend(section.get("dense_backend", "auto"), key=f"{MTRAINING_KEY}.dense_backend")
    except DenseBackendError as error:
        raise ConfigError(str(error)) from None
    attention, static = _attention_mode(section, seq_len, sparse.block_size)
    documents = _document_masking(section, attention)
    keep = _keep_attention_output(section, checkpointing)
    if attention == ULYSSES:
        _check_ulysses(section, documents, ring, keep)
    model = _model_spec(section.get("model", "tiny-qwen2"))
    tokenizer = section.get("tokenizer", "bytes")
    if tokenizer == "model":
        if model["name_or_path"] in PRESETS:
            raise ConfigError(f"{MTRAINING_KEY}.tokenizer='model' needs a model directory, but the model is "
                              f"the preset {model['name_or_path']!r}; use tokenizer 'bytes'")
        tokenizer = model["name_or_path"]
    return RunConfig(seq_len=seq_len, sequence_parallel_size=sp, ring=ring, sparse=sparse, model=model,
                     tokenizer=tokenizer, data=dict(section.get("data", {"source": "stdlib"})),
                     loss_chunk_tokens=_positive_int(section, "loss_chunk_tokens", 1024),
                     gradient_checkpointing=checkpointing, attention=attention, static=static,
                     document_masking=documents, liger=liger, keep_attention_output=keep,
                     memory=parse_memory(section, checkpointing), dense_backend=dense_backend,
                     stall_timeout_s=_stall_timeout(section),
                     max_nonfinite_steps=_count(section, "max_nonfinite_steps", 0))


def _stall_timeout(section: dict) -> float:
    value = section.get("stall_timeout_s", DEFAULT_STALL_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e7:
        raise ConfigError(f"{MTRAINING_KEY}.stall_timeout_s={value!r} must be a number of seconds >= 0 "
                          f"(0: no stall detection)")
    return value


def _count(section: dict, key: str, default: int) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{MTRAINING_KEY}.{key}={value!r} must be an integer >= 0")
    return value


def _boolean(section: dict, key: str) -> bool:
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{MTRAINING_KEY}.{key}={value!r} must be true or false")
    return value


def _keep_attention_output(section: dict, checkpointing: bool) -> bool:
    keep = _boolean(section, "keep_attention_output")
    if keep and not checkpointing:
        raise ConfigError(f"{MTRAINING_KEY}.keep_attention_output=true keeps each layer's attention output "
                          f"for the forward that activation checkpointing recomputes, and checkpointing is "
                          f"off: set {MTRAINING_KEY}.gradient_checkpointing to true, or this to false")
    return keep


def _attention_mode(section: dict, seq_len: int, block: int) -> tuple[str, dict | None]:
    """``attention`` (sparse | dense | static) and, for static, its validated ``static`` settings."""
    from ..static import ATTENTION_MODES, StaticPattern
    mode = section.get("attention", "sparse")
    if mode not in ATTENTION_MODES + (ULYSSES,):
        raise ConfigError(f"{MTRAINING_KEY}.attention={mode!r} is not an attention mode; use one of "
                          f"{list(ATTENTION_MODES)} or '{ULYSSES}' (sparse: MTraining's estimated index; dense: full "
                          f"causal attention; static: sinks + local window, set in {MTRAINING_KEY}.static; "
                          f"ulysses: the baseline, HF's dense attention under DeepSpeed-Ulysses)")
    if mode != "static":
        if "static" in section:
            raise ConfigError(f"{MTRAINING_KEY}.static is set but {MTRAINING_KEY}.attention is {mode!r}; "
                              f"set \"attention\": \"static\" or remove {MTRAINING_KEY}.static")
        return mode, None
    if "static" not in section:
        raise ConfigError(f"{MTRAINING_KEY}.attention='static' needs {MTRAINING_KEY}.static, e.g. "
                          f"{{\"density\": 0.1, \"sink_tokens\": 4}} or {{\"window_tokens\": 4096}}")
    try:
        pattern = StaticPattern.from_dict(section["static"])
        pattern.local_blocks(seq_len, block)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{MTRAINING_KEY}.static: {error}") from None
    return mode, pattern.to_dict()


def _document_masking(section: dict, attention: str) -> bool:
    """``document_masking``: true or false as given; left out, on wherever the loader packs
    documents (every data source but ``"random"``, whose samples have none) and the attention can
    mask them (not ``"ulysses"``)."""
    value = section.get("document_masking")
    if value is None:
        return attention != ULYSSES and dict(section.get("data", {})).get("source") != "random"
    if not isinstance(value, bool):
        raise ConfigError(f"{MTRAINING_KEY}.document_masking={value!r} must be true or false (or left out: "
                          f"on where the loader packs documents)")
    return value


def _check_ulysses(section: dict, document_masking: bool, ring: str, keep_output: bool):
    """What DeepSpeed-Ulysses (``attention: "ulysses"``) cannot do in this project's path."""
    where = f"{MTRAINING_KEY}.attention='{ULYSSES}'"
    if keep_output:
        raise ConfigError(f"{where} runs HF's SDPA attention, which recomputes under checkpointing as it is; "
                          f"{MTRAINING_KEY}.keep_attention_output applies to MTraining's attention: set it "
                          f"to false")
    if document_masking:
        raise ConfigError(f"{where} runs HF's SDPA attention, whose Ulysses wrapper drops the attention mask "
                          f"(only causal masking remains): it cannot mask documents. Set "
                          f"{MTRAINING_KEY}.document_masking to false, or use attention 'dense' (full "
                          f"attention through the ring, documents masked) as the dense baseline")
    if ring == "hierarchical":
        raise ConfigError(f"{where} has no ring (one all-to-all over the sequence-parallel group each way); "
                          f"remove {MTRAINING_KEY}.ring or set it to 'auto' or 'flat'")


def check_ulysses_heads(config, sequence_parallel_size: int, key: str = f"{MTRAINING_KEY}.model"):
    """Ulysses gives each of the W ranks whole attention heads: W must divide the query heads, and
    divide the key/value heads or be a multiple of them (then DeepSpeed replicates them)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    w = sequence_parallel_size
    fits = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    if heads % w != 0 or not (kv_heads % w == 0 or w % kv_heads == 0):
        raise ConfigError(
            f"{key}: {MTRAINING_KEY}.attention='{ULYSSES}' splits the heads over the sequence-parallel "
            f"ranks, but num_attention_heads={heads} / num_key_value_heads={kv_heads} cannot be split over "
            f"{MTRAINING_KEY}.sequence_parallel_size={w} (it must divide {heads}, and divide {kv_heads} or be a "
            f"multiple of it); use a sequence_parallel_size among {fits}, or MTraining's ring (any head count)")


def _data_override(value: str) -> dict:
    """``--data``: "stdlib", a folder (saved dataset, or json/jsonl/parquet/arrow/csv files),
    or comma-separated local files."""
    if value == "stdlib":
        return {"source": "stdlib"}
    if Path(value).is_dir():
        try:
            return folder_spec(value)
        except DataConfigError as error:
            raise ConfigError(str(error)) from None
    return {"files": value.split(",")}


def load_run_config(ds_config: str | dict, world_size: int, model: str | None = None,
                    data: str | None = None) -> tuple[RunConfig, dict]:
    """Reads a DeepSpeed JSON (path or dict), validates its ``mtraining`` section (with the
    ``--model``/``--data`` overrides) and returns it with the rest for DeepSpeed."""
    if isinstance(ds_config, dict):
        values = json.loads(json.dumps(ds_config))
    else:
        if not Path(ds_config).is_file():
            raise ConfigError(f"--deepspeed_config {ds_config!r} does not exist; pass a JSON file "
                              f"(see ds_configs/)")
        try:
            values = json.loads(Path(ds_config).read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"--deepspeed_config {ds_config}: invalid JSON ({error})") from None
    section = values.pop(MTRAINING_KEY, None)
    if section is None:
        raise ConfigError(f"the DeepSpeed JSON has no \"{MTRAINING_KEY}\" section; add one with at least "
                          f"\"seq_len\" (see ds_configs/cpu_demo.json)")
    section = dict(section)
    if model is not None:  # --model DIR keeps the JSON's config_overrides (e.g. a longer RoPE)
        given = section.get("model")
        section["model"] = {**given, "name_or_path": model} if isinstance(given, dict) else model
    if data is not None:
        section["data"] = _data_override(data)
    run = parse_run_config(section, world_size)
    try:
        check_data_spec(run.data, key=f"{MTRAINING_KEY}.data")
        tokenizer = load_tokenizer(run.tokenizer, key=f"{MTRAINING_KEY}.tokenizer")
    except DataConfigError as error:
        raise ConfigError(str(error)) from None
    from ds_mtraining.hf import training_device_type
    # the CUDA kernels' head dims bind MTraining's attention only, not the Ulysses baseline's
    config = check_model(run.model, tokenizer.vocab_size, None if run.attention == ULYSSES else training_device_type())
    if run.attention == ULYSSES:
        check_ulysses_heads(config, run.sequence_parallel_size, key=f"{MTRAINING_KEY}.model ({run.model['name_or_path']})")
    return run, values
