"""`mla-convert eval` and `mla-convert bench` through click's CliRunner, on tiny random
Llama models (an original and perturbed copies standing in for converted models)."""

from __future__ import annotations

import json

import click
import pytest
import torch
from click.testing import CliRunner

from mlakit.commands.bench_cmd import bench_command
from mlakit.commands.eval_cmd import eval_command
from mlakit.data import load_text, tokenize_text
from mlakit.eval import evaluate as evaluate_module
from mlakit.eval.loading import load_converted_model
from mlakit.eval.perplexity import sliding_window_perplexity
from tests.eval_helpers import char_tokenizer, save_tiny_llama

CONVERSION = {
    "source": "tiny",
    "method": "test-perturbation",
    "kv_budget": 0.5,
    "layers": [{"kv_lora_rank": 8, "qk_rope_head_dim": 4}, {"kv_lora_rank": 12, "qk_rope_head_dim": 2}],
}
FAST = ["--seq-len", "32", "--stride", "16", "--max-tokens", "200", "--sample-tokens", "0", "-q"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    orig = save_tiny_llama(root / "orig", seed=0)
    conv = save_tiny_llama(root / "conv", seed=0, perturb=0.02, tokenizer=False, conversion=CONVERSION)
    sweep = root / "sweep"
    save_tiny_llama(sweep / "r16", seed=0, perturb=0.01, tokenizer=False, conversion={"kv_budget": 0.25})
    save_tiny_llama(
        sweep / "r32",
        seed=0,
        perturb=0.005,
        tokenizer=False,
        num_key_value_heads=1,
        conversion={"kv_budget": 0.5},
    )
    bare = save_tiny_llama(root / "bare", seed=0, tokenizer=False)
    return {"orig": orig, "conv": conv, "sweep": sweep, "bare": bare, "root": root}


def _invoke(cmd, args):
    result = CliRunner().invoke(cmd, [str(a) for a in args])
    return result


def test_commands_register_in_a_group():
    group = click.Group("mla-convert")
    group.add_command(eval_command)
    group.add_command(bench_command)
    assert set(group.commands) == {"eval", "bench"}
    for name in ("eval", "bench"):
        res = CliRunner().invoke(group, [name, "--help"])
        assert res.exit_code == 0 and "--original" in res.output and "--converted" in res.output


def test_eval_writes_a_complete_report(models, tmp_path):
    out = tmp_path / "report"
    res = _invoke(
        eval_command,
        [
            "--original",
            models["orig"],
            "--converted",
            models["conv"],
            "--report",
            out,
            *FAST,
            "--sample-tokens",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "perplexity: original" in res.output and str(out) in res.output
    assert sorted(p.name for p in out.iterdir()) == [
        "kv_per_layer.png",
        "layer_ranks.png",
        "report.json",
        "report.md",
    ]
    assert not list(tmp_path.glob(".report.*"))  # no temp dir left behind
    rep = json.loads((out / "report.json").read_text())
    assert rep["conversion"] == CONVERSION  # verbatim
    assert rep["data"]["spec"] == "builtin" and rep["data"]["n_tokens"] == 200
    assert rep["settings"]["seq_len"] == 32 and rep["settings"]["stride"] == 16
    assert rep["settings"]["dtype"] == "float32" and rep["settings"]["device"] == "cpu"
    assert rep["ppl_ratio"] == pytest.approx(rep["converted"]["ppl"] / rep["original"]["ppl"])
    assert rep["original"]["kv_bytes_per_token"] == rep["converted"]["kv_bytes_per_token"] == 512
    assert rep["kv_reduction"] == 0.0
    assert rep["converted"]["layer_ranks"] == CONVERSION["layers"]
    assert len(rep["samples"]) == 4 and set(rep["samples"][0]) == {"prompt", "original", "converted"}

    # perplexities equal a direct computation on the same tokens
    tok = char_tokenizer()
    ids = tokenize_text(tok, load_text("builtin", "eval"))[:200]
    model = load_converted_model(models["conv"], torch.float32, torch.device("cpu"))
    direct = sliding_window_perplexity(model, ids, 32, 16, progress=False)
    assert rep["converted"]["ppl"] == pytest.approx(direct.ppl, rel=1e-6)
    assert rep["converted"]["perplexity"]["n_scored"] == 199

    md = (out / "report.md").read_text()
    for needle in (
        "Perplexity",
        "KV cache per token",
        "layer_ranks.png",
        "Greedy continuations",
        "kv_budget",
        "The capital of France is",
    ):
        assert needle in md


def test_eval_both_models_get_the_same_ids(models, monkeypatch):
    seen = []
    real = evaluate_module.sliding_window_perplexity

    def spy(model, ids, *args, **kwargs):
        seen.append(ids.clone())
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(evaluate_module, "sliding_window_perplexity", spy)
    res = _invoke(
        eval_command,
        ["--original", models["orig"], "--converted", models["conv"], *FAST],
    )
    assert res.exit_code == 0, res.output
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])


def test_eval_sweep_plots_ppl_against_kv(models, tmp_path):
    out = tmp_path / "sweep-report"
    args = ["--original", models["orig"], "--converted", models["sweep"], "--report", out, *FAST]
    res = _invoke(eval_command, args)
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    assert [e["label"] for e in rep["sweep"]] == ["r16", "r32"]
    assert rep["sweep"][1]["kv_bytes_per_token"] == 256 and rep["sweep"][1]["kv_reduction"] == pytest.approx(
        0.5
    )
    assert rep["conversion"] == {"kv_budget": 0.25}
    assert (out / "ppl_vs_kv.png").is_file() and "ppl_vs_kv.png" in rep["plots"]
    assert "layer_ranks.png" not in rep["plots"]  # plain models carry no ranks


def test_eval_says_when_it_scores_the_calibration_text(models, tmp_path, caplog):
    text = tmp_path / "notes.txt"
    text.write_text(load_text("builtin", "eval")[:4000], encoding="utf-8")
    conv = save_tiny_llama(tmp_path / "conv", seed=0, perturb=0.02, tokenizer=False,
                           conversion={"settings": {"calib": f"builtin,{text}"}})
    res = _invoke(eval_command, ["--original", models["orig"], "--converted", conv, "--data", text,
                                 "--report", tmp_path / "report", *FAST])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert rep["data"]["calibration"] == {"spec": f"builtin,{text}", "relation": "calibration text"}
    assert "this ratio is optimistic" in (tmp_path / "report" / "report.md").read_text()
    assert "its ratio is optimistic" in caplog.text
    res = _invoke(eval_command, ["--original", models["orig"], "--converted", conv, "--report",
                                 tmp_path / "builtin", *FAST])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "builtin" / "report.md").read_text()
    assert "disjoint from its calibration part but of the same kind" in md


def test_eval_rerun_replaces_an_old_report_but_not_other_folders(models, tmp_path):
    out = tmp_path / "r"
    args = ["--original", models["orig"], "--converted", models["conv"], *FAST]
    assert _invoke(eval_command, [*args, "--report", out]).exit_code == 0
    (out / "stale.txt").write_text("old")
    assert _invoke(eval_command, [*args, "--report", out]).exit_code == 0
    assert not (out / "stale.txt").exists() and (out / "report.json").is_file()
    other = tmp_path / "precious"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    res = _invoke(eval_command, [*args, "--report", other])
    assert res.exit_code != 0 and "not an mlakit report" in res.output
    assert (other / "keep.txt").read_text() == "x"


def test_eval_needs_a_tokenizer(models, tmp_path):
    args = ["--original", models["bare"], "--converted", models["bare"], *FAST]
    res = _invoke(eval_command, args)
    assert res.exit_code != 0 and "--tokenizer" in res.output
    res = _invoke(eval_command, [*args, "--tokenizer", models["orig"]])
    assert res.exit_code == 0, res.output
    assert "ratio 1.0000" in res.output


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--data", "no/such/file.txt"], "builtin"),
        (["--data", "hf:"], "malformed"),
        (["--stride", "32"], "smaller than --seq-len"),
        (["--dtype", "float8"], "float8"),
        (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "nonsense"], "device"),
    ],
)
def test_eval_user_errors(models, extra, needle):
    res = _invoke(eval_command, ["--original", models["orig"], "--converted", models["conv"], *FAST, *extra])
    assert res.exit_code != 0
    assert needle in res.output
    assert "Traceback" not in res.output


def test_eval_offline_hf_dataset_is_a_clear_error(models, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("cannot reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    res = _invoke(
        eval_command,
        [
            "--original",
            models["orig"],
            "--converted",
            models["conv"],
            *FAST,
            "--data",
            "hf:wikitext:wikitext-2-raw-v1:test",
        ],
    )
    assert res.exit_code == 2
    assert "hf:wikitext:wikitext-2-raw-v1:test" in res.output and "builtin" in res.output


def test_eval_local_text_file(models, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 5)
    res = _invoke(
        eval_command,
        [
            "--original",
            models["orig"],
            "--converted",
            models["conv"],
            "--data",
            text,
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--sample-tokens",
            "0",
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "tokens:     225" in res.output


def test_bench_writes_a_report(models, tmp_path):
    out = tmp_path / "bench"
    res = _invoke(
        bench_command,
        [
            "--original",
            models["orig"],
            "--converted",
            models["conv"],
            "--context-lengths",
            "8,16",
            "--batch-sizes",
            "1,2",
            "--new-tokens",
            "2",
            "--warmup",
            "0",
            "--report",
            out,
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["bench.png", "report.json", "report.md"]
    rep = json.loads((out / "report.json").read_text())
    assert rep["kind"] == "bench" and len(rep["comparison"]) == 4
    assert rep["original"]["kv_bytes_per_token"] == 512 and rep["conversion"] == CONVERSION
    row = rep["comparison"][-1]
    assert row["context_len"] == 16 and row["batch_size"] == 2
    assert row["converted_cache_bytes"] == 2 * (16 + 2) * 512
    assert "speedup" in (out / "report.md").read_text()


@pytest.mark.parametrize("value", ["a,b", "0,4", ""])
def test_bench_bad_lists(models, value):
    res = _invoke(
        bench_command,
        ["--original", models["orig"], "--converted", models["conv"], "--context-lengths", value],
    )
    assert res.exit_code == 2 and ("comma-separated" in res.output or "at least one" in res.output)


def test_bench_context_beyond_the_model(models):
    res = _invoke(
        bench_command,
        [
            "--original",
            models["orig"],
            "--converted",
            models["conv"],
            "--context-lengths",
            "600",
            "--batch-sizes",
            "1",
            "--warmup",
            "0",
            "-q",
        ],
    )
    assert res.exit_code != 0 and "max_position_embeddings" in res.output


def test_sweep_labels_are_unique(tmp_path):
    from mlakit.eval.evaluate import sweep_labels

    paths = [tmp_path / "a" / "out", tmp_path / "b" / "out", tmp_path / "r64"]
    assert sweep_labels(paths) == ["a/out", "b/out", f"{tmp_path.name}/r64"]
