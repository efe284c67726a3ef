"""Benchmark absorbed MLA decode: the Triton kernel vs the torch reference vs SDPA on expanded K/V.

For B in {1, 16, 64}, S in {1K, 8K, 32K}, H in {16, 128}, r=512, d_R=64, bf16, on CUDA:

- ``triton``: :func:`mlakit.kernels.decode_triton.mla_decode_triton` over the latent cache
- ``torch``:  :func:`mlakit.kernels.decode_reference.mla_decode_reference` (the CPU path)
- ``sdpa``:   ``F.scaled_dot_product_attention`` over per-head K (128 nope + 64 rope) and V (128)
  materialised from the latent cache as in DeepSeek (only the SDPA call is timed)

Bandwidth is the cache bytes a method must read (latent c_kv + k_rope for triton/torch, the
expanded K/V for sdpa) divided by its median time; %peak divides by ``--peak-gbps``. Times are
CUDA-event medians with the L2 flushed before each run; they include the Python wrapper's launch
overhead, which dominates the smallest configs. Configs that do not fit in memory are
skipped. Prints a Markdown table and writes JSON (``--out``). Without CUDA it says so and exits
0; ``--interpret-smoke`` then runs one tiny case through Triton's interpreter on CPU.

    python bench/kernel_bench.py --out kernel_bench.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

R, D_R, D_NOPE, D_V = 512, 64, 128, 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument(
        "--page-size", type=int, default=0, help="0: contiguous cache; else paged with this page size"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="device HBM peak in GB/s (H200: 4800)")
    p.add_argument(
        "--skip", nargs="*", default=[], choices=["triton", "torch", "sdpa"], help="methods to skip"
    )
    p.add_argument("--out", type=Path, default=Path("kernel_bench.json"))
    p.add_argument(
        "--interpret-smoke", action="store_true", help="no CUDA: run one tiny case in the interpreter"
    )
    return p.parse_args(argv)


def make_inputs(torch, B, S, H, dtype, device, page_size, gen):
    """Latent cache with every row full (lengths = S); paged layout uses a random page permutation."""
    q_lat = torch.randn(B, H, R, generator=gen, device=device).to(dtype)
    q_rope = torch.randn(B, H, D_R, generator=gen, device=device).to(dtype)
    c_kv = torch.randn(B, S, R, generator=gen, device=device).to(dtype)
    k_rope = torch.randn(B, S, D_R, generator=gen, device=device).to(dtype)
    lengths = torch.full((B,), S, dtype=torch.int32, device=device)
    block_table = None
    if page_size:
        n_pages = -(-S // page_size)
        pad = n_pages * page_size - S
        perm = torch.randperm(B * n_pages, generator=gen, device=device).view(B, n_pages)
        block_table = perm.to(torch.int32)

        def to_pages(x):
            x = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(B * n_pages, page_size, x.shape[-1])
            out = torch.empty_like(x)
            out[perm.flatten()] = x
            return out

        c_kv, k_rope = to_pages(c_kv), to_pages(k_rope)
    return q_lat, q_rope, c_kv, k_rope, lengths, block_table


def time_ms(torch, fn, warmup, iters, flush):
    """Median CUDA-event time of ``fn`` in ms, L2 flushed (``flush.zero_()``) before every run."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_sdpa(torch, c_kv, k_rope, block_table, B, S, H, scale, args, flush, gen):
    """Expand the latent cache per head as DeepSeek does and time only the SDPA call."""
    dtype, dev = c_kv.dtype, c_kv.device
    if block_table is not None:
        c_kv = c_kv[block_table.long()].view(B, -1, R)[:, :S]
        k_rope = k_rope[block_table.long()].view(B, -1, D_R)[:, :S]
    w_uk = torch.randn(R, H * D_NOPE, generator=gen, device=dev).to(dtype) * R**-0.5
    w_uv = torch.randn(R, H * D_V, generator=gen, device=dev).to(dtype) * R**-0.5
    k = torch.empty(B, H, S, D_NOPE + D_R, dtype=dtype, device=dev)  # K = [c_kv W_UK | k_rope]
    k[..., :D_NOPE] = (c_kv @ w_uk).view(B, S, H, D_NOPE).transpose(1, 2)
    k[..., D_NOPE:] = k_rope[:, None]
    v = (c_kv @ w_uv).view(B, S, H, D_V).transpose(1, 2).contiguous()  # V = c_kv W_UV  (B, H, S, 128)
    q = torch.randn(B, H, 1, D_NOPE + D_R, generator=gen, device=dev).to(dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return time_ms(torch, lambda: sdpa(q, k, v, scale=scale), args.warmup, args.iters, flush)


def bench_config(torch, B, S, H, args, flush, gen):
    from mlakit.kernels.decode_reference import mla_decode_reference
    from mlakit.kernels.decode_triton import mla_decode_triton

    dev, dtype, elt = "cuda", torch.bfloat16, 2
    row = {"B": B, "S": S, "H": H}
    free = torch.cuda.mem_get_info()[0]
    latent_bytes = B * S * (R + D_R) * elt
    sdpa_bytes = B * H * S * (D_NOPE + D_R + D_V) * elt
    if latent_bytes * 2 > 0.8 * free:
        return {**row, "skipped": f"latent cache needs {latent_bytes / 2**30:.1f} GiB"}
    q_lat, q_rope, c_kv, k_rope, lengths, block_table = make_inputs(
        torch, B, S, H, dtype, dev, args.page_size, gen
    )
    scale = (D_NOPE + D_R) ** -0.5
    inputs = (q_lat, q_rope, c_kv, k_rope, lengths)
    row["latent_bytes"] = latent_bytes
    out_tr = None
    if "triton" not in args.skip:
        fn = functools.partial(mla_decode_triton, *inputs, scale, block_table=block_table)
        out_tr = fn()[0]
        row["triton_ms"] = time_ms(torch, fn, args.warmup, args.iters, flush)
    if "torch" not in args.skip:
        try:
            fn = functools.partial(mla_decode_reference, *inputs, scale, block_table=block_table)
            out_ref = fn()[0]
            row["torch_ms"] = time_ms(torch, fn, args.warmup, args.iters, flush)
            if out_tr is not None:
                row["max_abs_err"] = float((out_tr.float() - out_ref.float()).abs().max())
            del out_ref
        except torch.cuda.OutOfMemoryError:
            row["torch_skipped"] = "CUDA out of memory"
        torch.cuda.empty_cache()
    if "sdpa" not in args.skip:
        if sdpa_bytes * 2.5 < 0.8 * torch.cuda.mem_get_info()[0]:
            try:
                row["sdpa_ms"] = bench_sdpa(
                    torch, c_kv, k_rope, block_table, B, S, H, scale, args, flush, gen
                )
                row["sdpa_bytes"] = sdpa_bytes
            except torch.cuda.OutOfMemoryError:
                row["sdpa_skipped"] = "CUDA out of memory"
        else:
            row["sdpa_skipped"] = f"expanded K/V needs {sdpa_bytes / 2**30:.0f} GiB"
    for m, nbytes in (("triton", latent_bytes), ("torch", latent_bytes), ("sdpa", sdpa_bytes)):
        if f"{m}_ms" in row:
            row[f"{m}_gbps"] = nbytes / row[f"{m}_ms"] / 1e6
            row[f"{m}_peak_frac"] = row[f"{m}_gbps"] / args.peak_gbps
    return row


def fmt(row, key, spec):
    return format(row[key], spec) if key in row else "-"


def markdown(rows, peak):
    head = (
        f"| B | S | H | triton ms | triton GB/s | % of {peak:g} | torch ms | torch GB/s | sdpa ms | "
        "sdpa GB/s | triton vs sdpa | max err |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['B']} | {r['S']} | {r['H']} | skipped: {r['skipped']} |" + " |" * 8)
            continue
        speed = f"{r['sdpa_ms'] / r['triton_ms']:.2f}x" if "sdpa_ms" in r and "triton_ms" in r else "-"
        pct = f"{100 * r['triton_peak_frac']:.0f}%" if "triton_peak_frac" in r else "-"
        lines.append(
            f"| {r['B']} | {r['S']} | {r['H']} | {fmt(r, 'triton_ms', '.4f')} | {fmt(r, 'triton_gbps', '.0f')} | "
            f"{pct} | {fmt(r, 'torch_ms', '.4f')} | {fmt(r, 'torch_gbps', '.0f')} | {fmt(r, 'sdpa_ms', '.4f')} | "
            f"{fmt(r, 'sdpa_gbps', '.0f')} | {speed} | {fmt(r, 'max_abs_err', '.1e')} |"
        )
    return "\n".join(lines)


def interpret_smoke(args):
    """One tiny case through the interpreter on CPU: proves the script and kernel wiring work."""
    import torch

    from mlakit.kernels.decode_reference import mla_decode_reference
    from mlakit.kernels.decode_triton import mla_decode_triton

    gen = torch.Generator().manual_seed(0)
    B, S, H = 1, 64, 16
    q_lat, q_rope, c_kv, k_rope, lengths, bt = make_inputs(
        torch, B, S, H, torch.float32, "cpu", args.page_size, gen
    )
    scale = (D_NOPE + D_R) ** -0.5
    t0 = time.perf_counter()
    out, _ = mla_decode_triton(q_lat, q_rope, c_kv, k_rope, lengths, scale, block_table=bt)
    t1 = time.perf_counter()
    want, _ = mla_decode_reference(q_lat, q_rope, c_kv, k_rope, lengths, scale, block_table=bt)
    t2 = time.perf_counter()
    row = {"B": B, "S": S, "H": H, "triton_ms": 1e3 * (t1 - t0), "torch_ms": 1e3 * (t2 - t1)}
    row["max_abs_err"] = float((out - want).abs().max())
    print("interpreter smoke test on CPU (times are interpreter times, not kernel times)")
    print(markdown([row], args.peak_gbps))
    assert row["max_abs_err"] < 1e-4, (
        f"interpreter result differs from the reference: {row['max_abs_err']:.3g}"
    )
    return [row]


def main(argv=None):
    args = parse_args(argv)
    if args.interpret_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before mlakit.kernels.decode_triton is imported
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    import torch

    if not torch.cuda.is_available():
        if not args.interpret_smoke:
            print(
                "kernel_bench: no CUDA device; nothing to benchmark (pass --interpret-smoke for a CPU check)"
            )
            return 0
        rows = interpret_smoke(args)
        args.out.write_text(json.dumps({"device": "cpu (interpreter)", "rows": rows}, indent=2))
        print(f"wrote {args.out}")
        return 0

    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # larger than any L2
    rows = []
    for H in args.heads:
        for B in args.batch:
            for S in args.seq:
                try:
                    row = bench_config(torch, B, S, H, args, flush, gen)
                except torch.cuda.OutOfMemoryError as e:
                    row = {"B": B, "S": S, "H": H, "skipped": f"CUDA OOM: {str(e).splitlines()[0][:60]}"}
                torch.cuda.empty_cache()
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    name = torch.cuda.get_device_name()
    print(f"\n{name}, bf16, r={R}, d_R={D_R}, page_size={args.page_size or 'contiguous'}\n")
    print(markdown(rows, args.peak_gbps))
    meta = {"device": name, "dtype": "bfloat16", "r": R, "d_R": D_R, "page_size": args.page_size}
    args.out.write_text(json.dumps({**meta, "peak_gbps": args.peak_gbps, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
