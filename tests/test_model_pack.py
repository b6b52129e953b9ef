"""bench.model_pack: a HF model directory packed into parts and unpacked again, against the
directory itself (exact mode: the same bytes; bf16 mode: each float32 tensor equal to the
original rounded to bfloat16, in float32), and the errors of a missing or damaged part."""
import json

import pytest
import torch

from ds_mtraining.bench.model_pack import MANIFEST, missing_parts, pack_model, unpack_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=300)
    folder = tmp_path_factory.mktemp("model") / "hf"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def _weights(folder):
    from safetensors.torch import load_file
    return load_file(folder / "model.safetensors")


def test_an_exact_pack_comes_back_byte_for_byte(model_dir, tmp_path):
    files = pack_model(model_dir, tmp_path / "pack", part_bytes=100_000)
    parts = files[:-1]
    assert files[-1].name == MANIFEST and len(parts) > 2 and all(p.stat().st_size <= 100_000 for p in parts)
    unpack_model(tmp_path / "pack", tmp_path / "back")
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == sorted(p.name for p in model_dir.iterdir())
    assert all((tmp_path / "back" / p.name).read_bytes() == p.read_bytes() for p in model_dir.iterdir())


def test_a_bf16_pack_halves_the_weights_and_restores_float32_at_bf16_precision(model_dir, tmp_path):
    from safetensors import safe_open
    from transformers import Qwen2ForCausalLM
    exact = sum(f.stat().st_size for f in pack_model(model_dir, tmp_path / "exact"))
    half = sum(f.stat().st_size for f in pack_model(model_dir, tmp_path / "pack", bf16=True))
    assert half < 0.55 * exact
    unpack_model(tmp_path / "pack", tmp_path / "back")
    original, back = _weights(model_dir), _weights(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, tensor in original.items():  # what a bf16 run trains from: the same bits
        assert back[name].dtype == tensor.dtype == torch.float32
        assert torch.equal(back[name], tensor.bfloat16().float())
        assert torch.equal(back[name].bfloat16(), tensor.bfloat16())
        assert (back[name] - tensor).abs().max() <= tensor.abs().max() * 2 ** -8  # bf16's rounding, no more
    with safe_open(str(tmp_path / "back" / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}  # as save_pretrained wrote it
    assert Qwen2ForCausalLM.from_pretrained(tmp_path / "back").dtype == torch.float32


def test_a_missing_or_damaged_part_is_named_and_nothing_is_written(model_dir, tmp_path):
    pack = tmp_path / "pack"
    files = pack_model(model_dir, pack, part_bytes=100_000)
    assert missing_parts(tmp_path / "nowhere") == [MANIFEST] and missing_parts(pack) == []
    files[1].rename(tmp_path / files[1].name)
    assert missing_parts(pack) == [files[1].name]
    with pytest.raises(FileNotFoundError, match=f"lacks {files[1].name}"):
        unpack_model(pack, tmp_path / "back")
    (tmp_path / files[1].name).rename(files[1])
    damaged = bytearray(files[0].read_bytes())
    damaged[10] ^= 1
    files[0].write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=f"{files[0].name} is damaged"):
        unpack_model(pack, tmp_path / "back")
    assert not (tmp_path / "back").exists()
    manifest = json.loads((pack / MANIFEST).read_text())
    assert manifest["bytes"] == sum(f.stat().st_size for f in files[:-1]) and not manifest["bf16"]


def test_packing_needs_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no Hugging Face model directory"):
        pack_model(tmp_path, tmp_path / "pack")
