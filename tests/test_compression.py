"""Compression: calibrated RoPE split, low-rank factorisations, budget planning, recipes."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mlakit import load_converted
from mlakit.arch import AttentionShape
from mlakit.cli import cli
from mlakit.convert.calibration import LayerStats
from mlakit.convert.compress import Method, compress_layer, layer_plan
from mlakit.convert.layer_metrics import layer_metrics
from mlakit.convert.low_rank import bkv_metric, full_rank, metric_factor
from mlakit.convert.mla_layer import convert_attention
from mlakit.convert.rank_plan import plan_ranks
from mlakit.convert.rope_select import auto_fold, transmla_fold
from mlakit.convert.rope_split import RopePlan
from mlakit.options import OptionsError
from mlakit.pipeline.api import ConvertOptions, convert
from mlakit.recipes import BUILTIN_RECIPES, Recipe, RecipeError
from tests.tiny_models import assert_close, random_attention

CALIB = dict(calib="random", calib_samples=8, calib_seq_len=32, dtype="float32", quiet=True)


def _logits(path, ids):
    with torch.no_grad():
        return load_converted(path)(ids).logits


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(3))


def test_low_rank_step_adds_nothing_at_full_rank(tiny_sources, tmp_path, ids):
    """Rotary dims dropped, latent at full rank: every factorisation gives the same model, so
    only the RoPE step changes the logits."""
    src = tiny_sources["llama_gqa"]
    outs = {}
    for low in ("rrr", "bkv_pca", "svd"):
        outs[low] = tmp_path / low
        convert(str(src), outs[low], ConvertOptions(rope_dim=8, lowrank_method=low, **CALIB))
    ref = _logits(outs["rrr"], ids)
    for low in ("bkv_pca", "svd"):
        assert_close(f"{low} vs rrr at full rank", _logits(outs[low], ids), ref, atol=1e-5)
    lossless = tmp_path / "lossless"
    convert(str(src), lossless, ConvertOptions(**CALIB))
    assert (ref - _logits(lossless, ids)).abs().max() > 1e-3  # dropping rotation does change the model


@pytest.mark.parametrize("fold", [1, 2, 4])
def test_orthogonal_head_mixing_keeps_scores_when_all_rope_is_kept(fold):
    """Mixing KV heads (and folded frequencies) by an orthogonal U changes nothing if every
    component stays rotary and folding is off, and keeps the NoPE map exact otherwise."""
    torch.manual_seed(0)
    H, G, d, D = 4, 2, 16, 12
    w = random_attention(H, G, d, D)
    n_grp, n = d // 2 // fold, G * fold
    U = torch.linalg.qr(torch.randn(n_grp, n, n, dtype=torch.float64))[0]
    plan = RopePlan(U, [], [], fold)  # everything dropped: pure NoPE
    mla = convert_attention(w, plan, full_rank)
    x = torch.cat([torch.randn(5, D), torch.ones(5, 1)], dim=1).double()
    # unrotated scores of the source == scores of the converted NoPE path
    q = (x @ w.q.double().T).view(5, H, d)
    k = (x @ w.k.double().T).view(5, G, d).repeat_interleave(H // G, dim=1)
    want = torch.einsum("thd,shd->hts", q, k)
    q_nope = (x @ mla.q_proj.T).view(5, H, d)
    c_kv = x @ mla.kv_a_proj_with_mqa.T
    k_nope = (c_kv @ mla.kv_b_proj.T).view(5, H, 2 * d)[..., :d]
    got = torch.einsum("thd,shd->hts", q_nope, k_nope)
    assert_close("NoPE scores after mixing", got, want, atol=1e-9, rtol=1e-9)


def test_metric_factor_is_exact_at_full_rank_and_bkv_is_a_metric():
    torch.manual_seed(0)
    w_y = torch.randn(10, 7, dtype=torch.float64)
    a = torch.randn(7, 7, dtype=torch.float64)
    sigma_half = a @ a.T / 7 + torch.eye(7, dtype=torch.float64)
    down, up = metric_factor(w_y, sigma_half, bkv_metric(w_y, sigma_half @ sigma_half, 4), 10)
    assert_close("up @ down", up @ down, w_y, atol=1e-9)
    down, up = metric_factor(w_y, sigma_half, torch.eye(10, dtype=torch.float64), 3)
    assert down.shape == (3, 7) and up.shape == (10, 3)


def test_planner_never_exceeds_budget():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        curves = []
        for _ in range(6):
            n = int(torch.randint(20, 60, (1,), generator=gen))
            s2 = torch.rand(n, generator=gen, dtype=torch.float64).sort(descending=True).values
            tail = torch.cat([s2.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
            curves.append(torch.log(tail + 1e-12))
        budget = int(torch.randint(24, 200, (1,), generator=gen))
        ranks = plan_ranks(curves, budget)
        assert sum(ranks) <= budget, (trial, ranks, budget)
        assert all(4 <= r < c.shape[0] for r, c in zip(ranks, curves))
    with pytest.raises(ValueError, match="below 4 per layer"):
        plan_ranks(curves, 10)


@pytest.mark.parametrize("fam, allocation", [("llama_gqa", "planned"), ("qwen2", "planned"), ("llama_mha", "uniform"),
                                             ("llama_gqa", "fisher"), ("qwen2", "fisher")])
def test_budget_conversion_fits_and_cache_matches_plan(tiny_sources, tmp_path, fam, allocation):
    out = tmp_path / "b"
    report = convert(str(tiny_sources[fam]), out, ConvertOptions(kv_budget=0.5, allocation=allocation, **CALIB))
    budget = report["plan"]["budget_values_per_token"]
    per_layer = [lay["kv_lora_rank"] + lay["qk_rope_head_dim"] for lay in report["layers"]]
    kv_heads = 4 if fam == "llama_mha" else 2
    assert sum(per_layer) <= budget == int(0.5 * 2 * 2 * kv_heads * 16)
    if allocation == "uniform":
        assert len(set(per_layer)) == 1
    model = load_converted(out)
    ids = torch.randint(3, 96, (1, 9))
    with torch.no_grad():
        out_ = model(ids, use_cache=True)
    cache = out_.cache if hasattr(out_, "cache") else out_.past_key_values
    measured = [(lay.keys.shape[-1] + lay.values.shape[-1]) for lay in cache.layers]
    assert measured == per_layer


@pytest.mark.parametrize("rope", ["scored", "transmla", "high", "uniform", "norm"])
def test_every_rope_method_builds_a_valid_model(tiny_sources, tmp_path, rope, ids):
    out = tmp_path / rope
    convert(str(tiny_sources["llama_mha"]), out, ConvertOptions(rope_dim=16, kv_lora_rank=40, rope_method=rope,
                                                                **CALIB))
    logits = _logits(out, ids)
    assert torch.isfinite(logits).all()
    cfg = json.loads((out / "config.json").read_text())
    assert len(cfg["rope_freq_index"][0]) == 8


def _random_layer(kv_heads: int, H: int = 4, d: int = 16, D: int = 24):
    """Random weights of KV_HEADS groups and their metrics from 200 random inputs (seed 0)."""
    torch.manual_seed(0)
    w = random_attention(H, kv_heads, d, D)
    x = torch.cat([torch.randn(200, D), torch.ones(200, 1)], 1).double()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    m = layer_metrics(w, LayerStats(x.T @ x / 200, torch.rand(H, 8, dtype=torch.float64) / 8, inv_freq, 200))
    return w, m


@pytest.mark.parametrize("half", [32, 64, 8])
def test_auto_fold_keeps_exact_frequencies_above_half_and_else_lets_every_group_keep_a_component(half):
    divisors = [f for f in range(1, half + 1) if half % f == 0]
    for n_keep in range(0, half + 1):
        fold = auto_fold(half, n_keep)
        assert half % fold == 0
        if 0 < n_keep <= half // 2:
            assert half // fold <= n_keep  # no more groups than kept components
            assert all(half // f > n_keep for f in divisors if f < fold)  # no smaller fold does that
        else:
            assert fold == 1
    # d/2 = 32 with 12 kept: the rule before (still TransMLA's method's) made 16 groups, so 4 kept nothing
    assert auto_fold(32, 12) == 4 and transmla_fold(32, 12) == 2
    assert auto_fold(32, 20) == transmla_fold(32, 20) == 1


def test_layer_plan_folds_by_the_auto_rule_unless_told():
    w, m = _random_layer(kv_heads=2)  # head_dim 16: d/2 = 8 frequencies, 3 kept: fold 4, 2 groups
    plan = layer_plan(w, m, Method(), rope_dim=6)
    assert plan.fold == 4 and plan.mixing.shape[0] == 2
    assert layer_plan(w, m, Method(fold=2), rope_dim=6).fold == 2


def test_compress_layer_shapes_follow_the_plan():
    torch.manual_seed(0)
    H, G, d, D = 4, 2, 16, 12
    w = random_attention(H, G, d, D)
    mla = compress_layer(w, None, Method(), rope_dim=8, rank=10)
    assert mla.kv_a_proj_with_mqa.shape == (18, D + 1) and mla.kv_b_proj.shape == (H * 2 * d, 10)
    assert mla.q_proj.shape == (H * (d + 8), D + 1)


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["tall", "wide"])  # W_y taller / wider than D + 1
def test_prepared_layer_gives_the_same_curve_and_layer_bit_for_bit(kv_heads):
    """``prepare_layer`` (what a two-pass conversion spills) changes nothing: the error curve and the
    rrr layer from it equal those computed from scratch, also after a round trip through tensors."""
    from mlakit.convert.compress import prep_from_tensors, prep_tensors, prepare_layer
    from mlakit.convert.layer_metrics import metrics_from_tensors, metrics_tensors
    from mlakit.convert.rank_plan import error_curve

    w, m = _random_layer(kv_heads)
    method = Method(lowrank="rrr")
    prep = prepare_layer(w, m, method, 8)
    back = prep_from_tensors(prep_tensors(prep))
    m_back = metrics_from_tensors(metrics_tensors(m))
    assert torch.equal(error_curve(w, m, method, 8), error_curve(w, m_back, method, 8, back))
    want = compress_layer(w, m, method, 8, rank=10)
    got = compress_layer(w, m_back, method, 8, rank=10, prep=back)
    for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.freq_index == want.freq_index


# ---- recipes -------------------------------------------------------------------------------

def test_recipe_rejects_unknown_keys_and_round_trips():
    with pytest.raises(RecipeError, match="kv_budgt"):
        Recipe.from_yaml("kv_budgt: 0.3")
    with pytest.raises(RecipeError, match="method.lowrnk"):
        Recipe.from_yaml("method: {lowrnk: rrr}")
    with pytest.raises(RecipeError, match="rope"):
        Recipe.from_yaml("method: {rope: nonsense}")
    r = Recipe(kv_budget=0.25, method={"rope": "transmla", "lowrank": "bkv_pca"}, calibration={"samples": 16})
    assert Recipe.from_yaml(r.to_yaml()) == r


@pytest.mark.parametrize("name", BUILTIN_RECIPES)
def test_builtin_recipes_load(name):
    recipe = Recipe.load(name)
    assert recipe.name == name
    opts = recipe.to_options()
    assert opts.kv_budget is not None or opts.kv_lora_rank != "full"


def test_cli_flags_override_recipe_and_effective_recipe_is_saved(tiny_sources, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: mine\nkv_budget: 0.5\nmethod: {lowrank: bkv_pca}\n"
                      "calibration: {data: random, samples: 8, seq_len: 32}\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["convert", str(tiny_sources["llama_gqa"]), str(out), "--recipe", str(recipe),
                                      "--lowrank-method", "rrr", "--dtype", "float32", "-q"])
    assert result.exit_code == 0, result.output
    saved = Recipe.load(out / "recipe.yaml")
    assert saved.name == "mine" and saved.kv_budget == 0.5 and saved.lowrank_method == "rrr"
    bad = CliRunner().invoke(cli, ["convert", str(tiny_sources["llama_gqa"]), str(tmp_path / "x"), "--recipe", "nope"])
    assert bad.exit_code != 0 and "neither a built-in" in bad.output


# ---- stock-form rope (for the deepseek-v3 export) -----------------------------------------------

@pytest.mark.parametrize("rope", ["scored", "transmla"])
def test_stock_rope_keeps_every_kth_frequency_once(tiny_sources, tmp_path, rope):
    out = tmp_path / rope
    report = convert(str(tiny_sources["llama_gqa"]), out,
                     ConvertOptions(kv_budget=0.5, rope_method=rope, stock_rope=True, **CALIB))
    cfg = json.loads((out / "config.json").read_text())
    d_r, half = cfg["qk_rope_head_dim"], cfg["head_dim"] // 2
    assert half % (d_r // 2) == 0  # 0.4 x 32 values -> nearest allowed d_R 16 of {2, 4, 8, 16}
    k = half // (d_r // 2)
    for freqs in cfg["rope_freq_index"]:
        assert sorted(freqs) == [k * s for s in range(d_r // 2)]
    assert report["verify"]["top1_agreement"] > 0


def test_stock_rope_refuses_dims_and_methods_it_cannot_express(tiny_sources, tmp_path):
    from mlakit.pipeline.api import ConversionError

    src = str(tiny_sources["llama_gqa"])  # head_dim 16: allowed rope dims 2, 4, 8, 16
    with pytest.raises(ConversionError, match=r"one of \[2, 4, 8, 16\]; got 12"):
        convert(src, tmp_path / "a", ConvertOptions(rope_dim=12, kv_lora_rank=20, stock_rope=True, **CALIB))
    with pytest.raises(ConversionError, match="got 32"):  # full rope, 2 KV heads: every frequency twice
        convert(src, tmp_path / "b", ConvertOptions(stock_rope=True, **CALIB))
    with pytest.raises(OptionsError, match="scored or transmla; got 'norm'"):  # refused when the options are made
        ConvertOptions(rope_dim=8, kv_lora_rank=20, rope_method="norm", stock_rope=True, **CALIB)
    assert not any(tmp_path.iterdir())


# ---- --lowrank-method auto ------------------------------------------------------------------------
def test_auto_lowrank_is_rrr_under_a_value_refit_and_from_a_quarter_of_the_cache_without():
    from mlakit.pipeline.api import AUTO_RRR_FROM, resolve_lowrank

    shape = AttentionShape("LlamaForCausalLM", 4, 2, 16, 64, False, False, None)  # 64 cached values per token per layer
    assert AUTO_RRR_FROM == 0.25
    for refine in ("none", "layer"):  # the closed form's switch
        for budget, want in ((0.5, "rrr"), (0.25, "rrr"), (0.2, "bkv_pca"), (0.1, "bkv_pca")):
            assert resolve_lowrank(ConvertOptions(kv_budget=budget, refine=refine), shape).lowrank_method == want
    for refine in ("auto", "values", "values-per-head"):  # a value refit follows: rrr at any budget
        for budget in (0.5, 0.2, 0.1):
            assert resolve_lowrank(ConvertOptions(kv_budget=budget, refine=refine), shape).lowrank_method == "rrr"
    assert resolve_lowrank(ConvertOptions(kv_budget=0.1, lowrank_method="rrr", refine="none"), shape).lowrank_method == "rrr"
    assert resolve_lowrank(ConvertOptions(kv_budget=0.1, lowrank_method="bkv_pca"), shape).lowrank_method == "bkv_pca"
    uniform = dict(kv_budget=None, rope_dim=8, refine="none")
    assert resolve_lowrank(ConvertOptions(kv_lora_rank=8, **uniform), shape).lowrank_method == "rrr"  # 16 of 64
    assert resolve_lowrank(ConvertOptions(kv_lora_rank=7, **uniform), shape).lowrank_method == "bkv_pca"


@pytest.mark.parametrize("pipeline", ["in-memory", "streaming"])
def test_auto_lowrank_builds_the_bkv_pca_conversion_below_a_quarter_and_says_so(tiny_sources, tmp_path, pipeline):
    src = str(tiny_sources["llama_gqa"])
    args = ["--kv-budget", "0.22", "--allocation", "uniform", "--calib", "random", "--calib-samples", "8",
            "--calib-seq-len", "32", "--dtype", "float32", "--pipeline", pipeline, "-q"]
    for name, extra in (("auto", []), ("bkv", ["--lowrank-method", "bkv_pca"]), ("refit", ["--refine", "values"])):
        res = CliRunner().invoke(cli, ["convert", src, str(tmp_path / name), *args, *extra])
        assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "auto" / "conversion.json").read_text())
    # --refine auto resolves to no refit at this tiny shape, so the closed form's switch applies (the refit is
    # resolved before the latent)
    assert (report["settings"]["refine"], report["settings"]["lowrank_method"]) == ("none", "bkv_pca")
    assert Recipe.load(tmp_path / "auto" / "recipe.yaml").lowrank_method == "bkv_pca"
    refit = json.loads((tmp_path / "refit" / "conversion.json").read_text())["settings"]
    assert (refit["refine"], refit["lowrank_method"]) == ("values", "rrr")
    assert Recipe.load(tmp_path / "refit" / "recipe.yaml").lowrank_method == "rrr"
    from safetensors.torch import load_file

    got, want = load_file(tmp_path / "auto" / "model.safetensors"), load_file(tmp_path / "bkv" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
