"""Conversion cost of the main job: wall time and peak RSS of ``mla-convert convert default``.

Runs ``mla-convert convert SRC OUT --recipe RECIPE -q`` (in-memory pipeline, logit verification
included) in a child process ``--runs`` times; the peak RSS is the child's own (``os.wait4``).
Before each run the bench measures this machine's float32 GEMM rate on a matrix product of the
default model's MLP shape, because machines of one type differ (the same code has taken
80 s and 160 s on different days): the rate says how fast the machine was, and the matmul work
of the calibration divided by it is a floor for the calibration's time on that machine. Before and
after each run it also times that floor directly: the bare decoder forward over the same calibration
tokens (``--no-forward-floor`` skips it); the run's wall is compared with the mean of the two, since the
machine's speed can change within a run of several minutes, and the two say by how much it did. Each
run's phase times come from the conversion's own ``conversion.json``. Writes bench/results/convert_cost.{md,json}.

    python bench/convert_cost.py                       # 3 runs of the main job
    python bench/convert_cost.py --runs 1 --no-write-results
    python bench/convert_cost.py --runs 1 --flags="--rope-dim measured" --name convert_cost_measured
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from child_process import cpu_name, run_measured

RESULTS = Path(__file__).resolve().parent / "results"
# on 2 CPU cores: wall and RSS from issue #3; the conversion's wall over the bare forward measured beside it
# from issue #19 (a ratio: this machine's speed drifts from day to day)
GOALS = {"wall_s": 90.0, "peak_rss_gb": 2.0, "x_bare_forward": 3.0}


def gemm_gflops(rows: int = 2048, inner: int = 576, cols: int = 1536, repeats: int = 30) -> float:
    """Median float32 GEMM rate of this machine, GFLOP/s, on an (rows x inner) @ (inner x cols) product."""
    a, w = torch.randn(rows, inner), torch.randn(cols, inner)
    torch.nn.functional.linear(a, w)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(a, w)
        times.append(time.perf_counter() - t)
    return 2 * rows * inner * cols / statistics.median(times) / 1e9


def forward_floor_s(src: str, recipe: str) -> float:
    """Seconds of the bare decoder forward over the recipe's calibration set, in batches of the
    calibration's size, with no statistics, no backward pass and no LM head: the part of the
    calibration no method can skip. Measured in a child process, like the conversion."""
    code = (
        "import json, time, torch\n"
        "from mlakit.pipeline import api as pipeline\n"
        "from mlakit.convert.calibration import BATCH_SIZE\n"
        "from mlakit.io.source import open_source\n"
        "from mlakit.recipes import Recipe\n"
        f"opts = Recipe.load({recipe!r}).to_options()\n"
        f"source = open_source({src!r})\n"
        "model = source.load_model(torch.float32, 'cpu')\n"
        "ids = pipeline.calibration_ids(source, opts, model.config.vocab_size)\n"
        "tick = time.perf_counter()\n"
        "with torch.no_grad():\n"
        "    for batch in ids.split(BATCH_SIZE):\n"
        "        model.model(input_ids=batch, use_cache=False)\n"
        "print(json.dumps({'forward_s': time.perf_counter() - tick}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the bare-forward child failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])["forward_s"]


def calibration_gflop(config: dict, report: dict, sensitivity_sequences: int) -> float:
    """Matrix-product work of the calibration (GFLOP): the forward over every calibration token
    (decoder layers only, the LM head is skipped), plus the backward and the LM head (forward and
    backward) over the sequences that measure the loss sensitivities."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    queries = config["num_attention_heads"] * config["head_dim"]
    kv_values = report["source_kv_values_per_token_per_layer"]  # keys and values of the source
    per_token = layers * (2 * hidden * queries + hidden * kv_values + 3 * hidden * inter)  # multiply-adds
    settings = report["settings"]
    tokens = settings["calib_samples"] * settings["calib_seq_len"]
    sens_tokens = sensitivity_sequences * settings["calib_seq_len"]
    head = hidden * config["vocab_size"]
    return 2 * (tokens * per_token + sens_tokens * (per_token + 2 * head)) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="default")
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-write-results", action="store_true")
    ap.add_argument("--no-forward-floor", action="store_true", help="skip the bare-forward timings around each run")
    ap.add_argument("--flags", default="", help="more mla-convert flags, e.g. '--rope-dim measured' "
                    "(none that changes the calibration: the bare forward reads the recipe's)")
    ap.add_argument("--name", default="convert_cost", help="results file name (bench/results/NAME.{md,json})")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="convert-cost-") as tmp:
        for i in range(args.runs):
            gflops = gemm_gflops()
            before = None if args.no_forward_floor else forward_floor_s(args.src, args.recipe)
            out = Path(tmp) / f"run{i}"
            cmd = [sys.executable, "-c", "from mlakit.cli import main; main()", "convert", args.src, str(out),
                   "--recipe", args.recipe, *shlex.split(args.flags), "-q"]
            res = run_measured(cmd, Path(tmp) / f"run{i}.log")
            report = json.loads((out / "conversion.json").read_text())
            config = json.loads((out / "config.json").read_text())
            work = calibration_gflop(config, report, report["plan"].get("sensitivity_sequences", 0))
            runs.append(res | {
                "peak_rss_gb": round(res.pop("peak_rss_bytes") / 1e9, 3),
                "gemm_gflops_before": round(gflops, 1),
                "calibration_matmul_gflop": round(work, 1),
                "calibration_floor_s": round(work / gflops, 1),
                "forward_before_s": None if before is None else round(before, 1),
                "forward_after_s": None if before is None else round(forward_floor_s(args.src, args.recipe), 1),
                "phase_seconds": report["pipeline"]["phase_seconds"],
                "kv_values_per_token": report["kv_values_per_token"],
            })
            if before is not None:
                run = runs[-1]
                run["forward_floor_s"] = round((run["forward_before_s"] + run["forward_after_s"]) / 2, 1)
                run["x_bare_forward"] = round(run["wall_s"] / run["forward_floor_s"], 2)
            print(json.dumps(runs[-1]), flush=True)
    result = {
        "command": " ".join(["mla-convert convert", args.src, "OUT --recipe", args.recipe, *shlex.split(args.flags),
                             "-q"]),
        "machine": {"platform": platform.platform(), "cpu": cpu_name() or platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads()},
        "goals": GOALS,
        "runs": runs,
        "median": {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "peak_rss_gb", "gemm_gflops_before",
                                                                       "x_bare_forward") if all(k in r for r in runs)},
    }
    md = markdown(result)
    print(md)
    if not args.no_write_results:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2))
        (RESULTS / f"{args.name}.md").write_text(md)


def markdown(result: dict) -> str:
    phases = list(result["runs"][0]["phase_seconds"] or {})
    head = ["run", "wall s", "peak RSS GB", "CPU s", "GEMM GFLOP/s", "calibration floor s",
            "bare forward before / after s", "wall / bare forward", *[f"{p} s" for p in phases]]
    lines = [f"Command: `{result['command']}`; {result['machine']['cpu']}, {result['machine']['torch_threads']} "
             f"torch threads. Goals: under {GOALS['wall_s']:.0f} s wall and {GOALS['peak_rss_gb']} GB peak RSS; at most "
             f"{GOALS['x_bare_forward']:.0f}x the bare forward measured beside it.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(result["runs"]):
        cells = [i + 1, r["wall_s"], r["peak_rss_gb"], r["cpu_s"], r["gemm_gflops_before"], r["calibration_floor_s"],
                 _before_after(r), r.get("x_bare_forward"), *[(r["phase_seconds"] or {}).get(p) for p in phases]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    med = result["median"]
    ratio = f", {med['x_bare_forward']}x the bare forward" if "x_bare_forward" in med else ""
    lines += ["", f"Median: {med['wall_s']} s wall{ratio}, {med['peak_rss_gb']} GB peak RSS, "
              f"GEMM {med['gemm_gflops_before']} GFLOP/s. The floor is the calibration's matrix-product work "
              f"({result['runs'][0]['calibration_matmul_gflop']} GFLOP) at the GEMM rate measured before the run. "
              "The bare forward is measured before and after the run: the decoder forward over the same calibration "
              "tokens in the same batches, with no statistics, backward pass or LM head (no method can skip it); the "
              "ratio is to the mean of the two.", ""]
    return "\n".join(lines)


def _before_after(run: dict) -> str | None:
    """The bare forward's cell: before / after the run (results before session 33 timed it after only)."""
    if run.get("forward_before_s") is not None:
        return f"{run['forward_before_s']} / {run['forward_after_s']}"
    return None if run.get("forward_floor_s") is None else f"– / {run['forward_floor_s']}"


if __name__ == "__main__":
    main()
