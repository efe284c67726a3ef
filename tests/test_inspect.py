"""`mla-convert inspect`: spectra, the budget plan, the written report and bad inputs (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mlakit.cli import cli
from mlakit.convert.inspect_model import dims_for_energy, energy_spectrum

pytestmark = pytest.mark.filterwarnings("ignore")

CALIB = ("--calib", "random", "--calib-samples", 8, "--calib-seq-len", 32)


def run(*args):
    result = CliRunner().invoke(cli, ["inspect", *map(str, args), "-q"])
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


def test_dims_for_energy_counts_leading_directions():
    eig = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    assert [dims_for_energy(eig, f) for f in (0.4, 0.41, 0.7, 0.9, 0.99, 1.0)] == [1, 2, 2, 3, 4, 4]
    assert dims_for_energy(torch.zeros(3, dtype=torch.float64), 0.9) == 0
    w, sigma = torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 7, dtype=torch.float64)
    sigma = sigma @ sigma.T
    got = energy_spectrum(w, sigma)
    want = torch.linalg.eigvalsh(w @ sigma @ w.T).flip(0)
    assert torch.allclose(got, want.clamp_min(0), atol=1e-9)


def test_inspect_report_plan_and_plot(tiny_sources, tmp_path):
    out = tmp_path / "inspect"
    code, text = run(tiny_sources["llama_gqa"], "--kv-budget", 0.5, "--out", out, *CALIB)
    assert code == 0, text
    assert sum(line.strip().startswith(("0 ", "1 ")) for line in text.splitlines()) == 2  # one row per layer
    assert "plan for --kv-budget 0.5" in text
    assert {p.name for p in out.iterdir()} == {"inspect.json", "spectra.png"}
    assert (out / "spectra.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".inspect.partial-*"))

    report = json.loads((out / "inspect.json").read_text())
    G, d = report["num_kv_heads"], report["head_dim"]
    assert (G, d, report["num_layers"], report["thresholds"]) == (2, 16, 2, [0.9, 0.99])
    for lay in report["layers"]:
        for part, size in (("k", G * d), ("v", G * d), ("kv", 2 * G * d)):
            eig, dims = lay[part]["eigenvalues"], lay[part]["dims"]
            assert len(eig) == size and all(a >= b >= 0 for a, b in zip(eig, eig[1:])), part
            assert 1 <= dims["0.9"] <= dims["0.99"] <= size, (part, dims)
        assert lay["kv"]["total_energy"] == pytest.approx(
            lay["k"]["total_energy"] + lay["v"]["total_energy"], rel=1e-4
        )
        rot = lay["rotary"]
        lead = torch.tensor(rot["lead_fraction"])
        assert lead.shape == (d // 2,) and bool(((lead >= 1 / G - 1e-6) & (lead <= 1 + 1e-6)).all())
        mixed, key = torch.tensor(rot["mixed_energy"]), torch.tensor(rot["key_energy"])
        assert torch.allclose(mixed.sum(1), key.sum(0), rtol=1e-4)  # mixing is orthogonal: energy kept
        assert torch.tensor(rot["drop_cost"]).shape == (d // 2, G)

    plan = report["plan"]
    assert plan["budget_values_per_token"] == int(0.5 * 2 * 2 * G * d)
    assert plan["values_per_token"] <= plan["budget_values_per_token"]
    for row in plan["layers"]:
        assert row["rope_dim"] == plan["rope_dim"] and 4 <= row["kv_lora_rank"] <= 2 * G * d - row["rope_dim"]
        assert 0 < row["latent_energy_kept"] <= 1 + 1e-9

    code, text = run(tiny_sources["llama_gqa"], "--out", out, *CALIB)  # an earlier inspect output is replaced
    assert code == 0, text
    assert json.loads((out / "inspect.json").read_text())["plan"] is None


def test_inspect_prints_only_without_out(tiny_sources, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, text = run(tiny_sources["mistral"], *CALIB)
    assert code == 0, text
    assert "rope lead" in text and "| " not in text and "plan for" not in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert [r[-1] for r in rows] == ["1.000", "1.000"]  # one KV head: mixing has nothing to concentrate
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("budget", ["0", "1.5", "-0.2"])
def test_kv_budget_outside_unit_interval(tiny_sources, budget):
    code, text = run(tiny_sources["llama_gqa"], "--kv-budget", budget, *CALIB)
    assert code == 2 and "--kv-budget" in text and "not in the range 0<x<=1" in text, text  # the model's bounds


def test_kv_budget_too_small_names_the_minimum(tiny_sources):
    code, text = run(tiny_sources["llama_gqa"], "--kv-budget", 0.01, *CALIB)
    assert code == 1 and "--kv-budget >=" in text and "rope dims" in text, text


def test_missing_source_and_foreign_out_dir(tmp_path, tiny_sources):
    code, text = run(tmp_path / "no_such_model", *CALIB)
    assert code == 1 and "does not exist" in text and "'default'" in text, text
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    code, text = run(tiny_sources["llama_gqa"], "--out", foreign, *CALIB)
    assert code == 2 and "not an earlier inspect output" in text, text
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"]


def test_inspect_a_converted_checkpoint_shows_each_layers_loss_before_and_after_refinement(tiny_sources, tmp_path):
    """On a checkpoint `convert` wrote, inspect calibrates nothing: it reads conversion.json and shows
    each layer's cache and, for a refined conversion, its loss before and after refinement."""
    from mlakit.pipeline.api import ConvertOptions, convert

    out = tmp_path / "refined"
    convert(str(tiny_sources["llama_gqa"]), out, ConvertOptions(
        kv_lora_rank=6, rope_dim=8, refine="layer", refine_epochs=1.0, refine_batch=4, calib="random",
        calib_samples=8, calib_seq_len=16, dtype="float32", quiet=True))
    layers = json.loads((out / "conversion.json").read_text())["layers"]
    res = CliRunner().invoke(cli, ["inspect", str(out), "--out", str(tmp_path / "ins")])
    assert res.exit_code == 0, res.output
    assert "loss before" in res.output and "refine layer" in res.output
    for rec in layers:
        row = next(line for line in res.output.splitlines() if line.split()[:3] == [str(rec["layer"]), "6", "8"])
        assert rec["refine"]["kept"] in row
        assert f"{rec['refine']['loss_before']:.4g}" in row and f"{rec['refine']['loss_after']:.4g}" in row
    saved = json.loads((tmp_path / "ins" / "inspect.json").read_text())
    assert [r["loss_after"] for r in saved["layers"]] == [r["refine"]["loss_after"] for r in layers]

    res = CliRunner().invoke(cli, ["inspect", str(out), "--kv-budget", "0.5"])
    assert res.exit_code == 2 and "converted checkpoint" in res.output and "pass the source" in res.output
