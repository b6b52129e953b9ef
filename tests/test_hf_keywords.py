"""No keyword dropped: every keyword the installed transformers' models pass to an attention
function (their ``attention_interface(...)`` calls, and the keyword arguments
their forwards carry: ``TransformersKwargs``) is honoured, inert or refused by
ds_mtraining.hf's attention function; a refused or unknown keyword, when set, gets one line
naming it. A keyword a new transformers adds fails here until it is classified."""
import functools
import re
from pathlib import Path

import pytest
import torch
import transformers
from transformers.utils.generic import TransformersKwargs

from ds_mtraining.hf import HONOURED_KEYWORDS, INERT_KEYWORDS, REFUSED_KEYWORDS, refuse_keywords

POSITIONAL = ("attention_mask",)  # the interface's own positional argument, checked separately


@functools.cache
def interface_keywords() -> dict[str, set[str]]:
    """{keyword: the model folders whose attention calls pass it}: the keyword arguments at the
    top level of each ``attention_interface(...)`` call (a scan of the call's text: ``ast`` over
    every model file takes ~20 s on 2 cores)."""
    found: dict[str, set[str]] = {}
    for path in (Path(transformers.__file__).parent / "models").glob("*/modeling_*.py"):
        text = path.read_text()
        for match in re.finditer(r"\battention_interface\(", text):
            for keyword in top_level_keywords(text, match.end()):
                found.setdefault(keyword, set()).add(path.parent.name)
    return found


def top_level_keywords(text: str, start: int) -> list[str]:
    """The ``name=`` keywords of the call whose arguments begin at ``text[start]`` (not those of
    calls nested in its arguments, nor ``**kwargs``)."""
    depth, names, i = 0, [], start
    while depth >= 0:
        char = text[i]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0:
            keyword = re.match(r"(?<![\w.])([A-Za-z_]\w*)\s*=(?!=)", text[i:i + 80])
            if keyword and (i == start or not (text[i - 1].isalnum() or text[i - 1] == "_")):
                names.append(keyword.group(1))
                i += keyword.end() - 1
        i += 1
    return names


def test_the_walk_finds_the_known_attention_calls():
    found = interface_keywords()
    assert {"scaling", "dropout", "sliding_window", "softcap", "s_aux"} <= set(found)
    assert "gemma2" in found["softcap"] and "gpt_oss" in found["s_aux"]


def test_every_keyword_of_the_installed_transformers_is_classified():
    keywords = set(interface_keywords()) | set(TransformersKwargs.__annotations__)
    classified = set(HONOURED_KEYWORDS) | set(INERT_KEYWORDS) | set(REFUSED_KEYWORDS) | set(POSITIONAL)
    assert not keywords - classified, f"keywords neither honoured, inert nor refused: {sorted(keywords - classified)}"


@pytest.mark.parametrize("name", sorted(REFUSED_KEYWORDS))
def test_a_refused_keyword_when_set_is_one_line_naming_it(name):
    module = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError) as error:
        refuse_keywords(module, {name: torch.zeros(2)})
    message = str(error.value)
    assert message.startswith(f"Linear passes {name}=<tensor (2,)> to its attention: ") and "\n" not in message
    refuse_keywords(module, {name: None})  # unset: nothing to honour


def test_an_unknown_keyword_is_refused_and_inert_ones_pass():
    module = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="passes attn_bias_magic=3 to its attention: MTraining attention does not "
                                         "know this keyword"):
        refuse_keywords(module, {"attn_bias_magic": 3})
    refuse_keywords(module, {name: True for name in INERT_KEYWORDS})


def test_softcap_reaches_the_kernels():
    """A softcap passed to the attention function caps the logits (float64 dense reference)."""
    from helpers import every_entry_config, tiny_model
    from ds_mtraining.hf import mtraining_attention_forward
    from ds_mtraining.layer import MTrainingAttentionSettings
    from ds_mtraining.reference import dense_attention
    model = tiny_model("qwen2")
    module = model.model.layers[0].self_attn
    module.mtraining_settings = MTrainingAttentionSettings(every_entry_config(128, 64))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 128, 16, generator=g) * 3 for heads in (4, 2, 2))  # [B, H, S, D]
    out, _ = mtraining_attention_forward(module, q, k, v, None, softcap=1.0)
    causal = torch.ones(128, 128, dtype=torch.bool).tril()
    want = dense_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), causal, softcap=1.0)
    uncapped = dense_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), causal)
    assert (want - uncapped).abs().max() > 0.1
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
