"""Cost of ``--allocation fisher`` against ``uniform``: the same random checkpoint converted both
ways, alternating, in child processes (``scale_bench.run_conversion``: streaming pipeline, CLI).

Fisher needs a statistics pass (each layer's metrics and error curve, spilled), a layer-wise
backward sweep for the loss sensitivities, and a convert pass; uniform converts in one pass. The
bench reports wall and CPU seconds of each run, their phases, and the fisher / uniform ratios of
the medians (CPU seconds are the steadier measure on a shared machine). Writes
bench/results/allocation_cost.{md,json}.

    python bench/allocation_cost.py                          # mid-size model, 2 runs each
    python bench/allocation_cost.py --layers 2 --hidden 256 --no-write-results   # quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

import scale_bench
from child_process import cpu_name

from mlakit.options import ConvertOptions

DEFAULTS = ConvertOptions()

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--dtype", choices=list(scale_bench.DTYPES), default="bf16")
    ap.add_argument("--kv-budget", type=float, default=0.25)
    ap.add_argument("--rope-dim", default="full", help="--rope-dim of both conversions")
    # the goal is about the default conversion: the calibration defaults are the converter's own
    ap.add_argument("--calib-samples", type=int, default=DEFAULTS.calib_samples)
    ap.add_argument("--calib-seq-len", type=int, default=DEFAULTS.calib_seq_len)
    ap.add_argument("--runs", type=int, default=2, help="runs of each allocation, alternating")
    ap.add_argument("--allocations", default="uniform,fisher", help="the first is the baseline")
    ap.add_argument("--nice", type=int, default=5)
    ap.add_argument("--omp-wait-policy", default="PASSIVE")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/mlakit_allocation_cost"))
    ap.add_argument("--no-write-results", action="store_true")
    args = ap.parse_args()
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    src = args.workdir / "src"
    size = scale_bench.write_checkpoint(src, args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate,
                                        args.vocab, scale_bench.DTYPES[args.dtype])
    allocations = args.allocations.split(",")
    runs = []
    try:
        for k in range(args.runs):
            for allocation in allocations:
                out = args.workdir / f"out-{allocation}-{k}"
                res = scale_bench.run_conversion(src, out, argparse.Namespace(**vars(args), allocation=allocation))
                rep = res["report"]
                row = {"allocation": allocation, "resolved": rep["plan"]["allocation"], "run": k,
                       "wall_s": res["wall_s"], "cpu_s": res["cpu_s"],
                       "peak_rss_gb": round(res["peak_rss_bytes"] / 1e9, 3),
                       "load_avg_1m_before_after": res["load_avg_1m_before_after"],
                       "phase_seconds": rep["pipeline"]["phase_seconds"],
                       "ranks": rep["plan"].get("ranks"),
                       "verify_max_abs_logit_diff": rep.get("verify", {}).get("max_abs_logit_diff")}
                runs.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    median = {a: {m: statistics.median(r[m] for r in runs if r["allocation"] == a) for m in ("wall_s", "cpu_s")}
              for a in allocations}
    base = allocations[0]
    ratios = {a: {m: round(median[a][m] / median[base][m], 3) for m in ("wall_s", "cpu_s")} for a in allocations[1:]}
    result = {
        "setup": {k: v for k, v in vars(args).items() if k not in ("workdir", "no_write_results")}
        | {"checkpoint_gb": round(size / 1e9, 3), "cpu": cpu_name(), "machine": platform.machine(),
           "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "runs": runs, "median": median, "ratio_to_" + base: ratios,
    }
    print(json.dumps({"median": median, "ratios": ratios}))
    if args.no_write_results:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "allocation_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Allocation cost: fisher against uniform",
        "",
        f"Random Llama checkpoint: {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV), "
        f"intermediate {args.intermediate}, vocab {args.vocab}, {args.dtype}; --kv-budget {args.kv_budget}, "
        f"--rope-dim {args.rope_dim}, calibration {args.calib_samples} x {args.calib_seq_len} random ids; streaming "
        f"pipeline, runs alternating, niceness {args.nice}, on {os.cpu_count()} CPUs shared with other jobs.",
        "Command: `python bench/allocation_cost.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| allocation | run | wall s | CPU s | peak RSS GB | load before/after | phases (wall s) |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for r in runs:
        phases = ", ".join(f"{k} {v}" for k, v in r["phase_seconds"].items())
        load = "/".join(map(str, r["load_avg_1m_before_after"]))
        lines.append(f"| {r['allocation']} | {r['run']} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_gb']} | {load} | "
                     f"{phases} |")
    lines += ["", "Median ratio to " + base + ": " + "; ".join(
        f"{a}: wall {v['wall_s']}x, CPU {v['cpu_s']}x" for a, v in ratios.items()) + "."]
    (RESULTS / "allocation_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
