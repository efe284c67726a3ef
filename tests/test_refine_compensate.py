"""--refine-compensate (convert/refine_values.compensating_target): the converted-stream value refit's target
weighs the source's function on the converted input against restoring the source's residual stream; the
share reaches the driver, the report and the recipe, and leaves layer 0 (where the streams agree) alone."""

from __future__ import annotations

import pytest
import torch
import yaml

from mlakit.arch import names
from mlakit.convert.refine import RefineSettings
from mlakit.convert.refine_values import compensating_target, sampled_sequences
from mlakit.convert.refit_moments import ridge_solve
from mlakit.pipeline.api import ConvertOptions, convert, convert_streaming
from tests.convert_helpers import assert_same_bytes, checkpoint_tensors

CALIB = dict(calib="random", calib_samples=48, calib_seq_len=32, dtype="float32", quiet=True)


def _batch(seed: int = 0, sequences: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(sequences, 5, 8, generator=g) for _ in range(3)]  # a, x, x'


def test_half_the_sequences_in_every_fold_run_the_source_attention():
    picked = sampled_sequences(0, 16)
    assert picked.tolist() == [True, True, False, False] * 4
    assert torch.equal(sampled_sequences(6, 4), picked[6:10])  # by index, whatever the batch
    for fold in (0, 1):  # sequence k is in fold k % 2
        assert int(picked[fold::2].sum()) == 4


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_half_is_the_share_that_bounds_both_aims_excess_losses_alike(share):
    """The default's reason (``compensating_target``): fitted toward f + S (g - f), aim f's loss exceeds its own
    best fit's by S^2 ||P (g - f)||^2 and aim g's by (1 - S)^2 times the same, so only S = 1/2 equalises them."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(400, 6, generator=g, dtype=torch.float64)
    f, gap = torch.randn(2, 400, 4, generator=g, dtype=torch.float64)

    def loss(aim, target):  # the fit toward TARGET, scored against AIM
        fitted = (ridge_solve(z.T @ z, z.T @ target, 1e-12) @ z.T).T
        return float((fitted - aim).square().sum())

    def excess(aim, target):  # over the loss of fitting AIM itself
        return loss(aim, target) - loss(aim, aim)

    blend = torch.lerp(f, gap, share)
    off_f, off_gap = excess(f, blend), excess(gap, blend)
    assert off_f / off_gap == pytest.approx(share**2 / (1 - share) ** 2, rel=1e-6)
    assert (off_f == pytest.approx(off_gap, rel=1e-6)) == (share == 0.5)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("first", [0, 2])
def test_the_target_weighs_the_source_function_against_the_stream_gap(share, first):
    """Sampled sequences read f through a + 2 (f - a), the others read a; at SHARE 1 f is never needed."""
    a, x, x_conv = _batch()
    calls = []

    def source_function(h):
        calls.append(h)
        return 2 * h + 1  # any function of the converted input

    got = compensating_target(a, x, x_conv, share, source_function, first)
    gap, f = a + (x - x_conv), 2 * x_conv + 1
    picked = sampled_sequences(first, 4)
    anchor = torch.where(picked[:, None, None], 2 * f - a, a)
    torch.testing.assert_close(got, (1 - share) * anchor + share * gap)
    if share == 1:  # the former target, bit for bit, and no source attention run for it
        assert torch.equal(got, gap) and not calls
    else:  # one run, on the sampled sequences only
        assert len(calls) == 1 and torch.equal(calls[0], x_conv[picked])
    # the least-squares target of (1 - share) ||y - anchor||^2 + share ||y - g||^2: its gradient vanishes there
    assert float(((1 - share) * (got - anchor) + share * (got - gap)).abs().max()) < 1e-5


def test_the_estimate_is_exact_where_the_drift_response_is_alike():
    """The control variate's error comes only from f - a differing between sequences: where every sequence
    has the same f - a, the targets summed over the batch (what the cross moment adds up) are the full
    blend's, (1 - share) f + share g."""
    a, x, x_conv = _batch(2)
    shift = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(3))
    picked = sampled_sequences(0, 4)

    def source_function(h):  # f - a is SHIFT in every sequence
        assert torch.equal(h, x_conv[picked])
        return a[picked] + shift

    for share in (0.0, 0.5):
        got = compensating_target(a, x, x_conv, share, source_function, 0)
        full = (1 - share) * (a + shift) + share * (a + x - x_conv)
        torch.testing.assert_close(got.sum(0), full.sum(0))


def test_where_the_streams_agree_every_share_gives_the_source_output():
    a, x, _ = _batch(1)
    for share in (0.0, 0.5, 1.0):
        assert torch.equal(compensating_target(a, x, x, share, lambda h: a[sampled_sequences(0, 4)], 0), a)


def test_bad_shares_are_refused_by_the_settings():
    for share in (-0.1, 1.5, "half"):
        with pytest.raises(ValueError, match="refine compensate must be a share in"):
            RefineSettings(method="values", compensate=share)


def _refitted(tensors: dict, layer: int) -> dict:
    prefix = names.attn_prefix(layer)
    return {k: t for k, t in tensors.items() if k.startswith(prefix) and (".kv_b_proj." in k or ".o_proj." in k)}


def test_the_share_reaches_the_refit_report_and_recipe(tiny_sources, tmp_path):
    """Layer 0 reads the same embeddings on both streams, so every share fits it toward the same target; each
    later layer's target moves with the share, and so do its start loss and refit. No share raises a loss."""
    base = dict(kv_lora_rank=20, rope_dim=8, **CALIB, refine="values")
    reports, weights = {}, {}
    for share in (0.0, 0.5, 1.0):
        out = tmp_path / f"share-{share}"
        opts = ConvertOptions(**base, refine_compensate=share)
        reports[share] = convert(str(tiny_sources["qwen2"]), out, opts)["layers"]
        weights[share] = checkpoint_tensors(out)
        assert all(r["refine"]["compensate"] == share for r in reports[share])
        assert all(r["refine"]["loss_after"] <= r["refine"]["loss_before"] for r in reports[share])
        assert yaml.safe_load((out / "recipe.yaml").read_text())["refine_compensate"] == share
    first = [reports[s][0]["refine"]["loss_before"] for s in reports]
    assert first == pytest.approx([first[0]] * 3, rel=1e-6), first
    for k, t in _refitted(weights[1.0], 0).items():
        torch.testing.assert_close(weights[0.0][k], t, rtol=1e-4, atol=1e-6)
    for layer in range(1, len(reports[1.0])):
        before = [reports[s][layer]["refine"]["loss_before"] for s in reports]
        assert len(set(before)) == 3, (layer, before)
    assert any(not torch.equal(weights[0.0][k], t) for k, t in _refitted(weights[1.0], 1).items())


def test_a_share_below_one_is_the_same_in_memory_and_streaming(tiny_sources, tmp_path):
    opts = ConvertOptions(kv_budget=0.4, allocation="fisher", **CALIB, refine="values", refine_compensate=0.25)
    mem = convert(str(tiny_sources["llama_gqa"]), tmp_path / "mem", opts)
    convert_streaming(str(tiny_sources["llama_gqa"]), tmp_path / "stream", opts)
    assert_same_bytes(tmp_path / "stream", tmp_path / "mem")
    assert any(r["refine"]["kept"] == "values refit" for r in mem["layers"])
