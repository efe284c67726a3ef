"""`mla-convert eval --tasks` through lm-evaluation-harness, offline: a multiple-choice task file
made here (the harness's YAML format over a local JSONL), scored on a tiny Llama and its MLA
conversion; errors for an unknown task and for a hub task whose data is not reachable."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from mlakit.cli import cli
from mlakit.pipeline.api import ConvertOptions, convert
from tests.eval_helpers import save_tiny_llama

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed: pip install 'mlakit[eval]'")

N_DOCS, N_CHOICES = 12, 3
FAST = ["--seq-len", "32", "--stride", "16", "--max-tokens", "200", "--sample-tokens", "0", "-q"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    orig = save_tiny_llama(root / "orig", seed=0)
    orig_conf = json.loads((orig / "config.json").read_text())
    orig_conf["architectures"] = ["LlamaForCausalLM"]
    (orig / "config.json").write_text(json.dumps(orig_conf))
    convert(str(orig), root / "conv", ConvertOptions(dtype="float32", quiet=True))
    rng = random.Random(0)
    with (root / "sums.jsonl").open("w") as f:
        for _ in range(N_DOCS):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            choices = [str(a + b), str(a + b + 1), str(a * b + 2)]
            f.write(json.dumps({"question": f"{a} plus {b} is", "choices": choices, "answer": 0}) + "\n")
    tasks = root / "task_files"
    tasks.mkdir()
    (tasks / "tiny_sums.yaml").write_text(
        "task: tiny_sums\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'sums.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return {"orig": orig, "conv": root / "conv", "tasks": tasks, "root": root}


def _eval(*args):
    return CliRunner().invoke(cli, ["eval", *map(str, args)])


def test_eval_tasks_scores_both_models_through_the_harness(setup, tmp_path):
    import lm_eval

    report_dir = tmp_path / "report"
    result = _eval(
        "--original", setup["orig"], "--converted", setup["conv"], *FAST,
        "--tasks", "tiny_sums", "--include-path", setup["tasks"], "--report", report_dir,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "tiny_sums (acc, 12 docs)" in result.output
    report = json.loads((report_dir / "report.json").read_text())
    st = report["tasks"]["settings"]
    assert st["harness"] == "lm-eval" and st["harness_version"] == lm_eval.__version__
    for m in (report["original"], report["converted"]):
        task = m["tasks"]["tiny_sums"]
        assert task["n_samples"] == N_DOCS
        assert 0.0 <= task["metrics"]["acc"] <= 1.0 and task["stderr"]["acc"] > 0
        # the harness asked the model for one log-likelihood per (document, choice)
        assert m["harness_requests"]["loglikelihood"] == N_DOCS * N_CHOICES
    assert report["converted"]["architecture"] != report["original"]["architecture"]  # the MLA model ran
    # a full-rank conversion is lossless: the same answers, to float rounding of the log-likelihoods
    o, c = (m["tasks"]["tiny_sums"]["metrics"]["acc"] for m in (report["original"], report["converted"]))
    assert o == c, f"lossless conversion changed accuracy {o} -> {c}"
    (row,) = report["tasks"]["rows"]
    assert (
        row["task"] == "tiny_sums"
        and row["metric"] == "acc"
        and set(row["values"]) == {"original", "converted"}
    )
    assert "task_accuracy.png" in report["plots"] and (report_dir / "task_accuracy.png").stat().st_size > 1000
    md = (report_dir / "report.md").read_text()
    assert "## Downstream accuracy (lm-evaluation-harness)" in md and "| tiny_sums | acc | 12 |" in md


def test_eval_tasks_errors_come_before_any_model_loads(setup, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the task error")

    monkeypatch.setattr("mlakit.eval.evaluate.load_original_model", no_model)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    base = ["--original", setup["orig"], "--converted", setup["conv"], *FAST]
    result = _eval(*base, "--tasks", "tiny_sumz", "--include-path", setup["tasks"])
    assert (
        result.exit_code == 2 and "unknown task 'tiny_sumz'" in result.output and "tiny_sums" in result.output
    )
    result = _eval(
        *base, "--tasks", "arc_easy"
    )  # a real harness task; its data is on the hub, unreachable here
    assert result.exit_code == 2, result.output
    assert (
        "task 'arc_easy': its data could not be reached" in result.output
        and "--include-path" in result.output
    )
    result = _eval(*base, "--tasks", ",")
    assert result.exit_code == 2 and "no task names" in result.output
