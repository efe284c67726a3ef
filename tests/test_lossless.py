"""Full-rank conversion of every supported family reproduces the source model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from mlakit import load_converted
from mlakit.mla_model.modeling_mla import MLAAttention
from mlakit.pipeline.api import ConvertOptions, convert
from tests.tiny_models import FAMILY_BUILDERS, assert_close

FAMILIES = list(FAMILY_BUILDERS)
LOGIT_ATOL = 1e-4  # fp32; observed ~2e-7 on these tiny models


@pytest.fixture(scope="module")
def converted(tiny_sources, tmp_path_factory):
    out = {}
    for fam in FAMILIES:
        dest = tmp_path_factory.mktemp("mla") / fam
        report = convert(str(tiny_sources[fam]), dest, ConvertOptions(dtype="float32", quiet=True))
        out[fam] = (dest, report)
    return out


def _pair(tiny_sources, converted, fam):
    src = AutoModelForCausalLM.from_pretrained(str(tiny_sources[fam]), dtype=torch.float32).eval()
    return src, load_converted(converted[fam][0])


def _left_padded_batch(vocab: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :11] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("fam", FAMILIES)
@torch.no_grad()
def test_full_rank_logits_match(tiny_sources, converted, fam):
    src, mla = _pair(tiny_sources, converted, fam)
    ids = torch.randint(3, src.config.vocab_size, (2, 40))  # 40 > the Mistral window of 8
    err = assert_close(f"{fam} logits", mla(ids).logits, src(ids).logits, atol=LOGIT_ATOL)
    print(f"{fam}: max |logit diff| = {err:.2e} (bound {LOGIT_ATOL})")
    assert converted[fam][1]["verify"]["max_abs_logit_diff"] <= LOGIT_ATOL


@pytest.mark.parametrize("fam", FAMILIES)
@torch.no_grad()
def test_greedy_generation_identical_with_left_padding(tiny_sources, converted, fam):
    src, mla = _pair(tiny_sources, converted, fam)
    ids, mask = _left_padded_batch(src.config.vocab_size)
    kw = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, pad_token_id=0)
    want = src.generate(ids, **kw)
    got = mla.generate(ids, **kw)
    assert torch.equal(got, want), f"{fam}: greedy tokens differ:\n{got}\n{want}"


@pytest.mark.parametrize("fam", ["llama_gqa", "mistral"])
@torch.no_grad()
def test_sampling_matches_source_under_same_seed(tiny_sources, converted, fam):
    src, mla = _pair(tiny_sources, converted, fam)
    ids, mask = _left_padded_batch(src.config.vocab_size)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(7)
    want = src.generate(ids, **kw)
    torch.manual_seed(7)
    got = mla.generate(ids, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fam", FAMILIES)
@torch.no_grad()
def test_absorbed_decode_equals_expanded(tiny_sources, converted, fam, monkeypatch):
    mla = load_converted(converted[fam][0])
    ids, mask = _left_padded_batch(mla.config.vocab_size)

    def step_logits():
        out = mla(ids, attention_mask=mask, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        m2 = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        return mla(nxt, attention_mask=m2, cache=cache, use_cache=True).logits[:, -1]

    absorbed = step_logits()
    monkeypatch.setattr(MLAAttention, "absorb_decode", False)
    expanded = step_logits()
    rows = mask.sum(-1) > 0
    assert_close(f"{fam} absorbed vs expanded", absorbed[rows], expanded[rows], atol=1e-5)


@pytest.mark.parametrize("fam", ["llama_gqa", "qwen2"])
@torch.no_grad()
def test_cache_holds_only_latent_and_rope_key(converted, fam):
    dest, report = converted[fam]
    mla = load_converted(dest)
    ids = torch.randint(3, mla.config.vocab_size, (2, 7))
    n_new = 9
    out = mla.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                       min_new_tokens=n_new, pad_token_id=0, return_dict_in_generate=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    tokens = 7 + n_new - 1  # the last generated token is never fed back
    planned = mla.config.cache_values_per_token()
    for i, layer in enumerate(cache.layers):
        values = (layer.keys.numel() + layer.values.numel()) / (2 * tokens)
        r, d_r = report["layers"][i]["kv_lora_rank"], report["layers"][i]["qk_rope_head_dim"]
        assert values == r + d_r == planned[i], f"layer {i}: {values} values per token, planned {r} + {d_r}"
