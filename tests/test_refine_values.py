"""--refine values (convert/refine_values.py, convert/refit_moments.py): the joint value / o_proj
refit from moments never raises the calibration loss, is a no-op when exact, lowers the loss of a
compressed tiny layer, and agrees with a direct forward; in the driver it writes the same bytes in
memory and streaming, stays bit-exact at full cache, and reaches the report and the recipe."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from mlakit.arch import names
from mlakit.convert import refine_values
from mlakit.convert.refine import RefineSettings, attention_output
from mlakit.convert.refine_values import ValueMoments, add_batch, latent_inputs, refit_values
from mlakit.io.work_dir import STORE_DTYPE, work_dir_for
from mlakit.pipeline import driver, run_state
from mlakit.pipeline.api import ConversionError, ConvertOptions, convert, convert_streaming
from tests import test_streaming
from tests.convert_helpers import assert_same_bytes, checkpoint_tensors, fast_args, layer_records, run
from tests.test_refine import layer_case, state_copy

deep_source = test_streaming.deep_source  # the 5-layer fixture


def _attention_loss(block, run, x, y) -> float:
    """sum ||attn(x) - y||^2 / sum ||y||^2 by a direct forward (y: the source attention's output)."""
    with torch.no_grad():
        got = attention_output(block, run, x).double()
    return float((got - y.double()).square().sum() / y.double().square().sum())


def _case(tiny_sources, family, rope_dim, rank):
    # 48 sequences: on 12 the held-out folds (6 x 32 tokens for up to 80 unknowns per output) never
    # favour the refit, and it is rightly skipped
    block, run, x, residual, built_from = layer_case(
        tiny_sources[family], family, rope_dim, rank, sequences=48
    )
    return block, run, x, residual - x, built_from  # the source attention's output


def _refit(block, run, x, y, batch: int = 5):
    moments = ValueMoments()
    for s in range(0, x.shape[0], batch):
        add_batch(moments, block, run, x[s : s + batch], y[s : s + batch], s)
    return refit_values(block, moments)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])  # mistral: a sliding window of 8 keys
@pytest.mark.parametrize("score_bytes,query_block", [(None, None), (1, None), (None, 5), (None, 10**6)])
def test_latents_reproduce_the_attention_output(tiny_sources, monkeypatch, family, score_bytes, query_block):
    """o_h = W_UV_h a_h: the latents times each head's value map, through o_proj, are the attention's output;
    also when the scores are taken one query at a time, in blocks that do not divide the sequence, or all
    at once (every key)."""
    if score_bytes is not None:
        monkeypatch.setattr(refine_values, "_SCORE_BYTES", score_bytes)
    if query_block is not None:
        monkeypatch.setattr(refine_values, "_QUERY_BLOCK", query_block)
    block, run, x, _, _ = _case(tiny_sources, family, 8, 20)
    attn = block.self_attn
    a = latent_inputs(block, run, x).detach()  # (N, T, H, r)
    H, d = attn.num_heads, attn.v_head_dim
    w_uv = attn.kv_b_proj.weight.detach().view(H, 2 * d, -1)[:, d:]
    z = torch.einsum("nthr,hdr->nthd", a, w_uv).reshape(*a.shape[:2], H * d)
    want = attention_output(block, run, x).detach()
    assert torch.allclose(attn.o_proj(z), want, atol=1e-5, rtol=1e-4), float(
        (attn.o_proj(z) - want).abs().max()
    )


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_layer_from_latents_is_the_decoder_layer(tiny_sources, family):
    """The latents a value refit gathered, through each head's value map, o_proj, the residual and the MLP,
    are the converted decoder layer's output: what carries the converted stream on without scoring again."""
    block, run, x, _, _ = _case(tiny_sources, family, 8, 20)
    with torch.no_grad():
        y = torch.randn_like(x)
        a = add_batch(ValueMoments(), block, run, x, y, 0)
        got, want = refine_values.layer_from_latents(block, x, a), run(block, x)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), float((got - want).abs().max())


def test_key_span_covers_every_key_a_block_may_see():
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    assert refine_values.key_span(causal[..., 4:8, :]) == slice(0, 8)
    window = causal & ~torch.ones(12, 12, dtype=torch.bool).tril(-3)[None, None]  # the last 3 keys
    assert refine_values.key_span(window[..., 4:8, :]) == slice(2, 8)
    blind = causal.clone()
    blind[..., 5, :] = False  # a row that sees nothing is uniform over every key, as in the model
    assert refine_values.key_span(blind[..., 4:8, :]) == slice(None)


def test_only_the_keys_some_query_may_not_see_are_masked():
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    assert refine_values.first_masked_key(causal[..., 4:8, :8]) == 5  # keys 0-4 are seen by queries 4-7
    assert refine_values.first_masked_key(causal[..., 8:12, :]) == 9
    assert refine_values.first_masked_key(causal[..., 11:12, :]) == 12  # the last query sees every key
    window = causal & ~torch.ones(12, 12, dtype=torch.bool).tril(-3)[None, None]
    assert refine_values.first_masked_key(window[..., 4:8, 2:8]) == 0  # query 7 no longer sees key 2


def test_full_rank_with_all_rope_kept_is_left_bit_exact(tiny_sources):
    block, run, x, y, _ = _case(tiny_sources, "qwen2", None, None)
    before = state_copy(block)
    report = _refit(block, run, x, y)
    assert report["loss_before"] < 1e-10 and report["kept"].startswith("start"), report
    for k, v in block.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
@pytest.mark.parametrize(
    "rank", [6, 20]
)  # r < head_dim 16 (no truncation) and r > head_dim (truncated per head)
def test_refit_reduces_the_loss_of_a_compressed_layer(tiny_sources, family, rank):
    block, run, x, y, built_from = _case(tiny_sources, family, 8, rank)
    snapshot = {k: v.clone() for k, v in built_from.items()}
    start = state_copy(block)
    report = _refit(block, run, x, y)
    # the moments' loss is the forward's (the refit's own bookkeeping is exact)
    assert abs(_attention_loss(block, run, x, y) - report["loss_after"]) <= 1e-5 * report["loss_before"], (
        report
    )
    # a bound with room: on these layers the refit removes 10-26% of the closed form's error
    assert report["loss_after"] < 0.92 * report["loss_before"], report
    assert report["kept"] == "values refit" and report["cv_loss_refit"] < report["cv_loss_start"], report
    changed = {k for k, v in block.state_dict().items() if not torch.equal(v, start[k])}
    assert changed == {names.attn(names.KV_B_PROJ), names.attn(names.O_PROJ)} | (
        {names.attn(names.O_PROJ, "bias")} if block.self_attn.o_proj.bias is not None else set()
    ), changed
    # only the value rows of kv_b_proj move: the keys, and so every score, are the closed form's
    H, d = block.self_attn.num_heads, block.self_attn.v_head_dim
    keys = lambda w: w.view(H, 2 * d, -1)[:, :d]  # noqa: E731
    assert torch.equal(keys(block.self_attn.kv_b_proj.weight), keys(start[names.attn(names.KV_B_PROJ)]))
    for k, v in built_from.items():  # the tensors the layer was built from are never written
        assert torch.equal(v, snapshot[k]), k


def test_refit_from_too_few_sequences_does_not_hurt_unseen_sequences(tiny_sources):
    """Moments of 2 short sequences (fewer tokens than the joint solve has unknowns per output) must not
    make unseen sequences worse: the refit keeps the closed form and says why. (Before the token count was
    checked, the held-out choice from one sequence per fold picked a ridge that made them 9% worse.)"""
    block, run, x, y, _ = _case(tiny_sources, "llama_gqa", 8, 20)
    fit, unseen = slice(0, 2), slice(4, 12)
    start = _attention_loss(block, run, x[unseen], y[unseen])
    report = _refit(block, run, x[fit, :12], y[fit, :12], batch=1)
    assert report["loss_after"] <= report["loss_before"], report
    assert _attention_loss(block, run, x[unseen], y[unseen]) <= start * (1 + 1e-6), report
    assert report["kept"] == "start" and "12 tokens, fewer than the 80 unknowns" in report["refit"], report


def test_refit_never_returns_a_higher_calibration_loss(tiny_sources):
    """Targets unrelated to the layer (noise): whatever the refit does, the calibration loss it reports
    is at most the start's, and a kept start leaves the weights bit for bit."""
    block, run, x, y, _ = _case(tiny_sources, "qwen2", 8, 6)
    noise = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    start = state_copy(block)
    report = _refit(block, run, x, noise)
    assert report["loss_after"] <= report["loss_before"], report
    if report["kept"] == "start":
        assert all(torch.equal(v, start[k]) for k, v in block.state_dict().items())


def test_refit_needs_two_sequences_to_validate(tiny_sources):
    block, run, x, y, _ = _case(tiny_sources, "llama_gqa", 8, 6)
    start = state_copy(block)
    report = _refit(block, run, x[:1], y[:1])
    assert report["refit"].startswith("skipped") and report["kept"] == "start", report
    assert all(torch.equal(v, start[k]) for k, v in block.state_dict().items())


def test_values_refit_takes_no_adam_epochs():
    with pytest.raises(ValueError, match="drop --refine-epochs"):
        RefineSettings(method="values", epochs=1.0)
    with pytest.raises(ValueError, match="not one of layer, values"):
        RefineSettings(method="adam")


# -- in the driver ---------------------------------------------------------------------------------

CALIB = dict(calib="random", calib_samples=48, calib_seq_len=32, dtype="float32", quiet=True)


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2"])
@pytest.mark.parametrize(
    "setting", [dict(kv_lora_rank=20, rope_dim=8), dict(kv_budget=0.4, allocation="fisher")]
)
@pytest.mark.parametrize("refine", [dict(refine="values"), dict(refine="values", refine_inputs="source"),
                                    dict(refine="values-per-head")])
def test_values_refit_is_the_same_in_memory_and_streaming(tiny_sources, tmp_path, family, setting, refine):
    opts = ConvertOptions(**setting, **CALIB, **refine)
    mem = convert(str(tiny_sources[family]), tmp_path / "mem", opts)
    got = convert_streaming(str(tiny_sources[family]), tmp_path / "stream", opts)
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert layer_records(got) == layer_records(mem)
    assert all(r["refine"]["loss_after"] <= r["refine"]["loss_before"] for r in mem["layers"])
    assert any(r["refine"]["kept"].startswith("values refit") for r in mem["layers"])
    convert(str(tiny_sources[family]), tmp_path / "plain", ConvertOptions(**setting, **CALIB, refine="none"))
    a, b = checkpoint_tensors(tmp_path / "mem"), checkpoint_tensors(tmp_path / "plain")
    assert any(not (a[k] == b[k]).all() for k in a if ".self_attn.o_proj." in k or ".kv_b_proj." in k)
    # only kv_b_proj and o_proj may differ from the closed form's
    assert all((a[k] == b[k]).all() for k in a if not (".kv_b_proj." in k or ".o_proj." in k))


@pytest.mark.parametrize("inputs", ["converted", "source"])
def test_values_refit_at_full_cache_stays_bit_exact(tiny_sources, tmp_path, inputs):
    base = dict(kv_budget=1.0, rope_dim=32, allocation="uniform", **CALIB)  # 2 KV heads x head_dim 16
    report = convert(str(tiny_sources["llama_gqa"]), tmp_path / "refined",
                     ConvertOptions(**base, refine="values", refine_inputs=inputs))
    convert(str(tiny_sources["llama_gqa"]), tmp_path / "plain", ConvertOptions(**base, refine="none"))
    assert_same_bytes(tmp_path / "refined", tmp_path / "plain")
    assert all(r["refine"]["kept"].startswith("start (already exact)") for r in report["layers"])


def test_values_refit_on_the_converted_stream_compensates_the_layers_below(tiny_sources, tmp_path):
    """Layer 0 sees the same embeddings on both streams, so both refits of it are the same; every later layer
    reads the converted stream, whose target carries the gap the layers below left: it starts from another
    loss, and its refit differs from the source-stream one."""
    base = dict(kv_lora_rank=20, rope_dim=8, **CALIB, refine="values")
    got, reports = {}, {}
    for inputs in ("converted", "source"):
        reports[inputs] = convert(str(tiny_sources["qwen2"]), tmp_path / inputs,
                                  ConvertOptions(**base, refine_inputs=inputs))["layers"]
        assert all(r["refine"]["inputs"] == inputs for r in reports[inputs])
        assert all(r["refine"]["loss_after"] <= r["refine"]["loss_before"] for r in reports[inputs])
        got[inputs] = checkpoint_tensors(tmp_path / inputs)
    before = [[r["refine"]["loss_before"] for r in reports[k]] for k in ("converted", "source")]
    assert before[0][0] == before[1][0] and all(a != b for a, b in zip(before[0][1:], before[1][1:])), before
    refitted = [[k for k in got["source"] if k.startswith(names.attn_prefix(i)) and (".kv_b_proj." in k or ".o_proj." in k)]
                for i in range(len(before[0]))]
    assert all(torch.equal(got["converted"][k], got["source"][k]) for k in refitted[0])
    assert any(not torch.equal(got["converted"][k], got["source"][k]) for ks in refitted[1:] for k in ks)
    recipe = yaml.safe_load((tmp_path / "converted" / "recipe.yaml").read_text())
    assert (recipe["refine"], recipe["refine_inputs"]) == ("values", "converted")


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_converted_stream_from_latents_matches_running_the_layer(tiny_sources, tmp_path, monkeypatch, family):
    """The converted-stream refit keeps each layer's latents and carries the stream on from them; with no disk
    to spare it computes them again: the same bytes either way, and nothing kept is left behind. Running the
    refitted layer whole instead differs only in the order of float32 sums (and where that flips a rounding
    to the store's dtype): each later layer starts from the same loss and gets the same refit to that rounding."""
    opts = ConvertOptions(kv_lora_rank=20, rope_dim=8, **CALIB, refine="values", refine_inputs="converted")
    kept = convert_streaming(str(tiny_sources[family]), tmp_path / "kept", opts)["layers"]
    assert not list(tmp_path.glob(".*partial*")) and not list((tmp_path / "kept").glob("hidden-*"))
    monkeypatch.setattr(driver.RefineSteps, "_latent_store", lambda self, i, block: None)
    convert_streaming(str(tiny_sources[family]), tmp_path / "again", opts)
    assert_same_bytes(tmp_path / "kept", tmp_path / "again")
    monkeypatch.setattr(driver.RefineSteps, "_from_latents", lambda self, refit, mla_layers: mla_layers.run)
    whole = convert_streaming(str(tiny_sources[family]), tmp_path / "whole", opts)["layers"]
    for key in ("loss_before", "loss_after"):
        losses = [[r["refine"][key] for r in layers] for layers in (kept, whole)]
        # rel: a flipped rounding of the stored stream moves the later layers' inputs by one bfloat16 step in a
        # few elements, which moves their loss by parts in ten thousand (how many flip varies with the host's
        # float32 sums); a wrong latent would move it by its whole size. abs: a relative loss's float32 noise
        # floor, reached where the refit's target is nearly met
        assert losses[0] == pytest.approx(losses[1], rel=1e-3, abs=1e-8), (key, losses)
    a, b = checkpoint_tensors(tmp_path / "kept"), checkpoint_tensors(tmp_path / "whole")
    assert a.keys() == b.keys()
    off = {k: float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a}
    assert max(off.values()) < 1e-3, off


def test_cli_refine_values_reaches_the_report_and_the_saved_recipe(tiny_sources, tmp_path):
    out = tmp_path / "out"
    code, text = run(
        tiny_sources["qwen2"], out, *fast_args(), "--refine", "values", "--refine-sequences", "3"
    )
    assert code == 0, text
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert (recipe["refine"], recipe["refine_sequences"]) == ("values", 3)
    report = json.loads((out / "conversion.json").read_text())
    assert report["settings"]["refine"] == "values"
    for r in report["layers"]:
        assert {"loss_before", "loss_after", "kept", "method"} <= set(r["refine"]), r
        assert r["refine"]["method"] == "values" and r["refine"]["sequences"] == 3


def test_cli_refine_values_with_epochs_names_the_flag(tiny_sources, tmp_path):
    code, text = run(
        tiny_sources["llama_gqa"],
        tmp_path / "out",
        *fast_args(),
        "--refine",
        "values",
        "--refine-epochs",
        "1",
    )
    assert code != 0 and "--refine-epochs" in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep_inputs", [True, False])
def test_two_pass_refit_starts_the_source_stream_from_the_embeddings(deep_source, tmp_path, monkeypatch, keep_inputs):
    """A statistics pass (fisher) leaves the source slots at the last layer's hidden states; the
    convert pass must read layer 0's kept inputs or embed again, or layer 0 is refitted on another
    layer's inputs (a bug that kept in-memory and streaming identical, and only perplexity showed)."""
    import numpy as np
    from safetensors.torch import load_file

    if not keep_inputs:
        monkeypatch.setattr(driver, "KEEP_INPUTS_SHARE", 0.0)
    src, out, seen = deep_source, tmp_path / "out", {}  # 5 layers: the last one's input sits in slot 0

    def hook(phase, index):
        if (phase, index) == ("convert", 0):
            name = "hidden-input-00000.bin" if keep_inputs else "hidden-0.bin"
            seen["hidden"] = np.fromfile(work_dir_for(out) / name, dtype=np.int16)  # the bits of STORE_DTYPE
            seen["kept"] = sorted(p.name for p in work_dir_for(out).glob("hidden-input-*"))

    opts = ConvertOptions(kv_budget=0.4, allocation="fisher", **CALIB, refine="values")
    convert_streaming(str(src), out, opts, on_layer=hook)
    emb = load_file(str(src / "model.safetensors"))[names.EMBED]
    n, t = CALIB["calib_samples"], CALIB["calib_seq_len"]
    ids = torch.randint(0, emb.shape[0], (n, t), generator=torch.Generator().manual_seed(0))  # calib="random"
    assert torch.equal(torch.from_numpy(seen["hidden"]).view(STORE_DTYPE).view(n, t, -1), emb[ids].to(STORE_DTYPE))
    assert seen["kept"] == ([f"hidden-input-{i:05d}.bin" for i in range(5)] if keep_inputs else [])


@pytest.mark.parametrize("refine", ["values", "layer"])
def test_kept_inputs_give_the_same_bytes_as_a_second_source_run(tiny_sources, tmp_path, monkeypatch, refine):
    """Two-pass plans that refine read each layer's source inputs kept by the statistics pass; with no disk
    to spare they run the source stream again: the same checkpoint either way, and no kept file is left."""
    opts = ConvertOptions(kv_budget=0.4, allocation="fisher", **CALIB, refine=refine)
    kept = convert_streaming(str(tiny_sources["llama_gqa"]), tmp_path / "kept", opts)
    monkeypatch.setattr(driver, "KEEP_INPUTS_SHARE", 0.0)
    again = convert_streaming(str(tiny_sources["llama_gqa"]), tmp_path / "again", opts)
    assert_same_bytes(tmp_path / "kept", tmp_path / "again")
    assert [r["refine"]["loss_after"] for r in kept["layers"]] == [r["refine"]["loss_after"] for r in again["layers"]]
    assert not list(tmp_path.glob(".*partial*")) and not list((tmp_path / "kept").glob("hidden-*"))


def test_values_refit_too_large_for_the_memory_is_refused_before_any_work(tiny_sources, tmp_path):
    """The joint solve's moments grow as (H r)^2: a setting whose one layer would not fit is refused
    with the size, the limit and the way out, before the source is calibrated or anything is written."""
    out = tmp_path / "out"
    code, text = run(tiny_sources["qwen2"], out, *fast_args(), "--refine", "values", "--max-memory", "100KB")
    assert code != 0 and "--refine values" in text and "--refine layer" in text and "--max-memory" in text, text
    assert not out.exists()


def test_auto_is_the_value_refit_where_it_fits_and_none_elsewhere(tiny_sources, tmp_path, caplog, monkeypatch):
    """The default (--refine auto) gives --refine values' bytes on a compressed conversion, names the
    refit in the saved recipe and report; falls back to no refit where the joint solve would not fit
    (where --refine values is refused, above) and where a lossless conversion has nothing to refit."""
    src = str(tiny_sources["qwen2"])
    setting = dict(kv_budget=0.4, allocation="fisher", **CALIB)
    auto = convert(src, tmp_path / "auto", ConvertOptions(**setting))
    convert(src, tmp_path / "values", ConvertOptions(**setting, refine="values"))
    assert_same_bytes(tmp_path / "auto", tmp_path / "values")
    assert auto["settings"]["refine"] == "values"
    assert yaml.safe_load((tmp_path / "auto" / "recipe.yaml").read_text())["refine"] == "values"
    assert any(r["refine"]["kept"] == "values refit" for r in auto["layers"])

    def too_large(shape, rank, max_memory, method):  # a tiny model's moments always fit: stand in for a 7B one's
        raise ValueError("--refine values solves for all heads' latents at once: at kv_lora_rank 2496 one layer's "
                         "float64 moments take about 189.6 GiB, more than half of this machine's memory. Use ...")

    monkeypatch.setattr(run_state, "check_values_refit", too_large)
    caplog.set_level("INFO", logger="mlakit.pipeline.run_state")
    small = convert_streaming(src, tmp_path / "small", ConvertOptions(**setting))
    assert small["settings"]["refine"] == "none" and all("refine" not in r for r in small["layers"])
    assert "--refine auto: no value refit, the closed form only. --refine values solves" in caplog.text
    with pytest.raises(ConversionError, match="189.6 GiB"):  # asked for by name, it is refused
        convert(src, tmp_path / "refused", ConvertOptions(**setting, refine="values"))

    lossless = convert(src, tmp_path / "full", ConvertOptions(kv_lora_rank="full", rope_dim="full", quiet=True))
    assert lossless["settings"]["refine"] == "none"


def test_auto_reads_the_stream_its_refit_reads(tiny_sources, tmp_path, caplog, monkeypatch):
    """--refine-inputs auto becomes converted under the joint refit and source under the per-head one (each
    named in the saved recipe); asked for converted, auto skips the per-head refit, which cannot read it, and
    a lossless conversion (nothing to refit) keeps the flag without an error."""
    src, setting = str(tiny_sources["qwen2"]), dict(kv_budget=0.4, allocation="uniform", **CALIB)
    joint = convert(src, tmp_path / "joint", ConvertOptions(**setting))
    assert (joint["settings"]["refine"], joint["settings"]["refine_inputs"]) == ("values", "converted")

    def joint_too_large(shape, rank, max_memory, method):
        if method == "values":
            raise ValueError("--refine values solves for all heads' latents at once: too large here")

    monkeypatch.setattr(run_state, "check_values_refit", joint_too_large)
    monkeypatch.setattr(run_state, "REFIT_WORK_SHARE", 1e9)  # a tiny model's per-head refit costs more than its share
    per_head = convert(src, tmp_path / "per-head", ConvertOptions(**setting))
    assert (per_head["settings"]["refine"], per_head["settings"]["refine_inputs"]) == ("values-per-head", "source")
    recipe = yaml.safe_load((tmp_path / "per-head" / "recipe.yaml").read_text())
    assert (recipe["refine"], recipe["refine_inputs"]) == ("values-per-head", "source")
    caplog.set_level("INFO", logger="mlakit.pipeline.run_state")
    converted = convert(src, tmp_path / "converted", ConvertOptions(**setting, refine_inputs="converted"))
    assert converted["settings"]["refine"] == "none"
    assert "values-per-head reads the source stream, and --refine-inputs converted was asked for" in caplog.text
    lossless = convert(src, tmp_path / "full", ConvertOptions(kv_lora_rank="full", rope_dim="full", quiet=True,
                                                              refine_inputs="converted"))
    assert lossless["settings"]["refine"] == "none"


def test_auto_skips_the_value_refit_whose_work_exceeds_its_share_of_the_forward(tiny_sources, tmp_path, caplog,
                                                                                 monkeypatch):
    """Where the joint solve fits the memory but its arithmetic would pass REFIT_WORK_SHARE of the layer's
    forward, auto is the closed form (logged); --refine values, asked for by name, still runs."""
    src, setting = str(tiny_sources["llama_gqa"]), dict(kv_budget=0.4, allocation="uniform", **CALIB)
    monkeypatch.setattr(run_state, "REFIT_WORK_SHARE", 0.0)
    caplog.set_level("INFO", logger="mlakit.pipeline.run_state")
    auto = convert(src, tmp_path / "auto", ConvertOptions(**setting))
    assert auto["settings"]["refine"] == "none" and "x a layer's forward arithmetic" in caplog.text
    named = convert(src, tmp_path / "named", ConvertOptions(**setting, refine="values"))
    assert named["settings"]["refine"] == "values" and all("refine" in r for r in named["layers"])


def test_values_refit_work_at_real_shapes():
    """The rule auto applies: the joint refit within the share at SmolLM2's shape, over it at 7B shapes with a
    512 latent, whose (32 x 512)^2 moments and cubic solves outgrow the layer's forward; the per-head refit
    within it there; neither for Llama-2-7B (32 KV heads) at 68.75% less KV, a 2496 latent."""
    from types import SimpleNamespace

    from mlakit.arch.families import AttentionShape
    from mlakit.pipeline.stream_memory import REFIT_WORK_SHARE, values_refit_work

    tokens = 128 * 256
    smollm2, mlp = AttentionShape("llama", 9, 3, 64, 576, False, False, None), SimpleNamespace(intermediate_size=1536)
    llama3 = AttentionShape("llama", 32, 8, 128, 4096, False, False, None), SimpleNamespace(intermediate_size=14336)
    llama2 = AttentionShape("llama", 32, 32, 128, 4096, False, False, None), SimpleNamespace(intermediate_size=11008)
    work = lambda model, rank, method, refit=tokens: values_refit_work(model[1], model[0], rank, 64, 256, tokens,  # noqa: E731
                                                                       refit, method)
    assert values_refit_work(mlp, smollm2, 116, 48, 256, tokens, tokens, "values") < REFIT_WORK_SHARE
    assert work(llama3, 512, "values") > REFIT_WORK_SHARE > work(llama3, 512, "values-per-head")
    assert work(llama2, 2496, "values-per-head") > REFIT_WORK_SHARE
    # half the sequences refitted: the per-token share halves, the solves' stays
    full = values_refit_work(mlp, smollm2, 116, 48, 256, tokens, tokens)
    half = values_refit_work(mlp, smollm2, 116, 48, 256, tokens, tokens // 2)
    assert full / 2 < half < full


def test_values_refit_memory_check_at_real_shapes():
    from mlakit.arch.families import AttentionShape
    from mlakit.pipeline.stream_memory import check_values_refit, values_refit_bytes

    smollm2 = AttentionShape("llama", 9, 3, 64, 576, False, False, None)
    llama7b = AttentionShape("llama", 32, 32, 128, 4096, False, False, None)
    assert values_refit_bytes(smollm2, 116) < 2**27  # the main job's largest layer: under 128 MiB
    check_values_refit(smollm2, 116, None)
    # Llama-2-7B at 68.75% less KV (r + d_R = 2560): hundreds of GiB
    with pytest.raises(ValueError, match="kv_lora_rank 2496"):
        check_values_refit(llama7b, 2496, 64 * 2**30)
    # head by head the same layer fits: each head's (r + d)^2 moments and o_proj's, a few GiB
    check_values_refit(llama7b, 2496, 64 * 2**30, "values-per-head")
    assert values_refit_bytes(llama7b, 512, "values-per-head") < 2**31
