"""Triton flash-decoding kernel for single-token absorbed MLA decode over the latent cache.

Semantics are those of :func:`mlakit.kernels.decode_reference.mla_decode_reference` (the
float32 torch oracle). Tensors of :func:`mla_decode_triton`:

- ``q_lat``       (B, H, r)      fp32 | bf16 | fp16, query absorbed through W_UK
- ``q_rope``      (B, H, d_R)    same dtype as ``q_lat``; d_R may be 0
- ``c_kv``        contiguous (B, S_max, r) or paged (num_pages, page_size, r), same dtype
- ``k_rope``      contiguous (B, S_max, d_R) or paged (num_pages, page_size, d_R), same dtype
- ``lengths``     (B,)           int32 | int64, valid tokens of each row (<= capacity)
- ``scale``       float          softmax scale applied to the full score
- ``block_table`` (B, max_pages) int32 | int64, paged layout only: token t of row b is at
  ``c_kv[block_table[b, t // page_size], t % page_size]``
- ``starts``      (B,)           int32 | int64, optional: tokens before ``starts[b]`` are masked
- returns ``out`` (B, H, r) in q_lat's dtype and ``lse`` (B, H) fp32 (natural log);
  a row with no valid token gives zeros and ``lse = -inf``.

Any strides are accepted (e.g. ``cache[:, 0]`` of a (B, 1, S, r) buffer is used as is).

Algorithm (flash-decoding): program (b, head tile, split) walks its share of row b's valid
tokens in BLOCK_N tiles. Each c_kv tile (BLOCK_N, r) is loaded once and used for both the
score dot ``q_lat @ c_kv^T`` and the value dot ``p @ c_kv`` of all BLOCK_H heads of the tile;
scores, running max/sum and the accumulator are fp32. With one split the kernel writes the
final output; otherwise each split writes a normalised partial output and its LSE and a
second kernel merges them. Under ``TRITON_INTERPRET=1`` (CPU tests) tiles are upcast to fp32
before ``tl.dot`` because the interpreter's low-precision dot is wrong; the probabilities are
still rounded to the input dtype first so the numerics match the GPU path.
"""

from __future__ import annotations

import contextlib
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module stays importable (and copyable beside checkpoints) without triton
    triton = None
    tl = None

__all__ = ["mla_decode_triton", "TRITON_AVAILABLE", "pick_num_splits"]

TRITON_AVAILABLE = triton is not None
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)
_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 256  # GPU: fewer tokens per split is not worth the merge
_INTERPRET_MIN_SPLIT_TOKENS = 32  # interpreter: small splits so CPU tests exercise the merge


def pick_num_splits(batch: int, heads: int, capacity: int, num_sms: int, min_split_tokens: int) -> int:
    """Splits per row: enough programs for ~2 waves over the SMs, each split >= min_split_tokens.

    Uses the cache capacity rather than ``lengths.max()`` so the call never syncs the host.
    """
    if capacity <= 0 or batch <= 0:
        return 1
    programs = batch * math.ceil(heads / 16)
    want = math.ceil(2 * num_sms / programs)
    return max(1, min(want, math.ceil(capacity / min_split_tokens), _MAX_SPLITS))


if TRITON_AVAILABLE:
    # Own tiny helpers instead of tl.cdiv / tl.max / tl.sum / tl.zeros: those are @jit functions of
    # triton.language.standard, and when triton was imported before TRITON_INTERPRET=1 was set
    # (torch._dynamo imports it) they stay compiled-mode functions the interpreter cannot call.
    # Helpers defined here follow the mode in force when this module is imported.

    @triton.jit
    def _cdiv(a, b):
        return (a + b - 1) // b

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _add_combine(a, b):
        return a + b

    @triton.jit
    def _mla_decode_split_kernel(
        Q, QR, CKV, KR, Lens, Starts, BT, Out, LSE,
        scale, H, R, DR, page_size, num_splits, split_len_hint,
        s_qb, s_qh, s_qr,
        s_qrb, s_qrh, s_qrd,
        s_cb, s_cs, s_cr,
        s_kb, s_ks, s_kd,
        s_btb, s_btp,
        s_ob, s_oh, s_os, s_or,
        s_lb, s_lh, s_ls,
        HAS_ROPE: tl.constexpr, HAS_STARTS: tl.constexpr, PAGED: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        LOG2E: tl.constexpr = 1.4426950408889634
        LN2: tl.constexpr = 0.6931471805599453
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
        pid_s = tl.program_id(2)
        b64 = pid_b.to(tl.int64)

        # this split's share [lo, hi) of the row's valid tokens [start, length)
        length = tl.load(Lens + pid_b).to(tl.int32)
        start = 0
        if HAS_STARTS:
            start = tl.maximum(tl.load(Starts + pid_b).to(tl.int32), 0)
        n_valid = tl.maximum(length - start, 0)
        chunk = _cdiv(_cdiv(n_valid, num_splits), BLOCK_N) * BLOCK_N
        lo = start + pid_s * chunk
        hi = tl.minimum(lo + chunk, length)

        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        q = tl.load(
            Q + b64 * s_qb + offs_h[:, None] * s_qh + offs_r[None, :] * s_qr,
            mask=mask_h[:, None] & mask_r[None, :],
            other=0.0,
        )  # (BLOCK_H, BLOCK_R)
        if UPCAST:
            q = q.to(tl.float32)
        if HAS_ROPE:
            offs_d = tl.arange(0, BLOCK_DR)
            mask_d = offs_d < DR
            qr = tl.load(
                QR + b64 * s_qrb + offs_h[:, None] * s_qrh + offs_d[None, :] * s_qrd,
                mask=mask_h[:, None] & mask_d[None, :],
                other=0.0,
            )  # (BLOCK_H, BLOCK_DR)
            if UPCAST:
                qr = qr.to(tl.float32)

        qk_scale = scale * LOG2E  # scores kept in log2 units: exp2 instead of exp
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_H, BLOCK_R], 0.0, dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            if PAGED:
                page = tl.load(BT + b64 * s_btb + (offs_n // page_size) * s_btp, mask=mask_n, other=0)
                row_c = page.to(tl.int64) * s_cb + (offs_n % page_size).to(tl.int64) * s_cs
                row_k = page.to(tl.int64) * s_kb + (offs_n % page_size).to(tl.int64) * s_ks
            else:
                row_c = b64 * s_cb + offs_n.to(tl.int64) * s_cs
                row_k = b64 * s_kb + offs_n.to(tl.int64) * s_ks
            # the one load of this latent tile: used by the score dot and the value dot
            kv = tl.load(
                CKV + row_c[:, None] + offs_r[None, :] * s_cr,
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
            )  # (BLOCK_N, BLOCK_R)
            kv_dot = kv.to(tl.float32) if UPCAST else kv
            s = tl.dot(q, tl.trans(kv_dot), input_precision=DOT_PREC)  # (BLOCK_H, BLOCK_N) fp32
            if HAS_ROPE:
                kr = tl.load(
                    KR + row_k[:, None] + offs_d[None, :] * s_kd,
                    mask=mask_n[:, None] & mask_d[None, :],
                    other=0.0,
                )  # (BLOCK_N, BLOCK_DR)
                if UPCAST:
                    kr = kr.to(tl.float32)
                s += tl.dot(qr, tl.trans(kr), input_precision=DOT_PREC)
            s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # finite: the tile has >= 1 valid token
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _add_combine)
            p_dot = p.to(kv.dtype)  # rounded as the tensor-core dot will see it
            if UPCAST:
                p_dot = p_dot.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_dot, kv_dot, input_precision=DOT_PREC)
            m_i = m_new

        has = l_i > 0.0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
        o_ptrs = Out + b64 * s_ob + offs_h[:, None] * s_oh + pid_s * s_os + offs_r[None, :] * s_or
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_r[None, :])
        tl.store(LSE + b64 * s_lb + offs_h * s_lh + pid_s * s_ls, lse, mask=mask_h)

    @triton.jit
    def _mla_decode_merge_kernel(
        PO, PL, Out, LSE, R, num_splits,
        s_pob, s_poh, s_pos, s_por,
        s_plb, s_plh, s_pls,
        s_ob, s_oh, s_or,
        s_lb, s_lh,
        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        pid_b = tl.program_id(0).to(tl.int64)
        pid_h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        lse_s = tl.load(
            PL + pid_b * s_plb + pid_h * s_plh + offs_s * s_pls, mask=offs_s < num_splits, other=float("-inf")
        )  # (BLOCK_S,)
        m = tl.reduce(lse_s, 0, _max_combine)
        m = tl.where(m == float("-inf"), 0.0, m)  # empty row: every weight below is 0
        total = tl.reduce(tl.exp(lse_s - m), 0, _add_combine)
        inv_total = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, total, 1.0), 0.0)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        acc = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
        for s in range(0, num_splits):
            w = tl.exp(tl.load(PL + pid_b * s_plb + pid_h * s_plh + s * s_pls) - m) * inv_total
            part = tl.load(
                PO + pid_b * s_pob + pid_h * s_poh + s * s_pos + offs_r * s_por, mask=mask_r, other=0.0
            )
            acc += w * part
        lse = tl.where(total > 0.0, m + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        tl.store(Out + pid_b * s_ob + pid_h * s_oh + offs_r * s_or, acc.to(Out.dtype.element_ty), mask=mask_r)
        tl.store(LSE + pid_b * s_lb + pid_h * s_lh, lse)

    def prune_configs(configs, named_args, **kwargs):
        """Drop configs that waste a head or token tile or would spill registers.

        Register rule, calibrated on sm_90/sm_80 compiles (ptxas -res-usage) at r=512 and 128: the
        fp32 accumulator plus the q and c_kv tiles (c_kv counted twice for fp32) must stay within
        512 bytes per thread, and the c_kv tile within 16K elements; beyond that ptxas spills
        (hundreds of bytes to >8 KB of stack).
        Configs that overflow shared memory raise OutOfResources and the autotuner skips them.
        """
        args = {**named_args, **kwargs}
        block_r, heads, split_len = args["BLOCK_R"], args["H"], args["split_len_hint"]
        elt = args["CKV"].element_size()
        kept = []
        for cfg in configs:
            bh, bn = cfg.kwargs["BLOCK_H"], cfg.kwargs["BLOCK_N"]
            if bh > max(16, triton.next_power_of_2(heads)) or bn > max(16, triton.next_power_of_2(split_len)):
                continue
            kv_bytes = bn * block_r * elt * (2 if elt == 4 else 1)  # fp32 "ieee" dots keep a second copy
            bytes_per_thread = (bh * block_r * (4 + elt) + kv_bytes) / (32 * cfg.num_warps)
            if bytes_per_thread > 512 or bn * block_r > 16384:
                continue
            kept.append(cfg)
        return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_H"], c.kwargs["BLOCK_N"], -c.num_warps))]

    AUTOTUNE_CONFIGS = [
        triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bh in (16, 32)
        for bn in (16, 32, 64)
        for w in (4, 8)
        for st in (1, 2)
    ]
    _mla_decode_split_autotuned = triton.autotune(
        configs=AUTOTUNE_CONFIGS,
        key=["H", "R", "DR", "split_len_hint", "PAGED"],
        prune_configs_by={"early_config_prune": prune_configs},
    )(_mla_decode_split_kernel)
    _INTERPRET = type(_mla_decode_split_kernel).__name__ == "InterpretedFunction"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"mla_decode_triton: {msg}")


def mla_decode_triton(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    c_kv: torch.Tensor,
    k_rope: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_table: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode; shapes and semantics in the module docstring.

    ``num_splits`` overrides the split heuristic (:func:`pick_num_splits`); tests use it.
    """
    if not TRITON_AVAILABLE:
        raise RuntimeError(
            "mla_decode_triton needs triton (pip install triton); use backend='torch' or MLAKIT_DECODE=torch"
        )
    _check(q_lat.dim() == 3, f"q_lat must be (B, H, r), got shape {tuple(q_lat.shape)}")
    B, H, r = q_lat.shape
    _check(r > 0, "q_lat's latent dim r is 0; nothing to attend over")
    _check(
        q_rope.dim() == 3 and q_rope.shape[:2] == (B, H),
        f"q_rope must be (B={B}, H={H}, d_R), got {tuple(q_rope.shape)}",
    )
    d_r = q_rope.shape[2]
    _check(q_lat.dtype in _DTYPES, f"q_lat dtype {q_lat.dtype} is not one of {_DTYPES}")
    for name, t in (("q_rope", q_rope), ("c_kv", c_kv), ("k_rope", k_rope)):
        _check(
            t.dtype == q_lat.dtype, f"{name} dtype {t.dtype} != q_lat dtype {q_lat.dtype}; cast with .to()"
        )
    paged = block_table is not None
    _check(
        c_kv.dim() == 3 and c_kv.shape[2] == r,
        f"c_kv must be {'(num_pages, page_size, r)' if paged else '(B, S_max, r)'} with r={r}, "
        f"got {tuple(c_kv.shape)}",
    )
    _check(
        k_rope.dim() == 3 and k_rope.shape[:2] == c_kv.shape[:2] and k_rope.shape[2] == d_r,
        f"k_rope must be {tuple(c_kv.shape[:2]) + (d_r,)} (c_kv's leading dims, q_rope's d_R), "
        f"got {tuple(k_rope.shape)}",
    )
    _check(
        lengths.shape == (B,) and lengths.dtype in _INT_DTYPES,
        f"lengths must be (B={B},) int32/int64, got {tuple(lengths.shape)} {lengths.dtype}",
    )
    if starts is not None:
        _check(
            starts.shape == (B,) and starts.dtype in _INT_DTYPES,
            f"starts must be (B={B},) int32/int64 or None, got {tuple(starts.shape)} {starts.dtype}",
        )
    if paged:
        _check(
            block_table.dim() == 2 and block_table.shape[0] == B and block_table.dtype in _INT_DTYPES,
            f"block_table must be (B={B}, max_pages) int32, got {tuple(block_table.shape)} {block_table.dtype}",
        )
        capacity = block_table.shape[1] * c_kv.shape[1]
    else:
        _check(
            c_kv.shape[0] == B,
            f"contiguous c_kv must have batch {B} first, got {tuple(c_kv.shape)}; "
            "pass block_table for a paged cache",
        )
        capacity = c_kv.shape[1]
    dev = q_lat.device
    for name, t in (("q_rope", q_rope), ("c_kv", c_kv), ("k_rope", k_rope)):
        _check(
            t.device == dev, f"{name} is on {t.device}, q_lat on {dev}; move q and the cache to one device"
        )
    # the integer metadata may live elsewhere, as the reference allows (a no-op when already on dev)
    lengths = lengths.to(dev, non_blocking=True)
    starts = None if starts is None else starts.to(dev, non_blocking=True)
    block_table = None if block_table is None else block_table.to(dev, non_blocking=True)
    if dev.type != "cuda" and not _INTERPRET:
        raise RuntimeError(
            f"mla_decode_triton got {dev.type} tensors: set TRITON_INTERPRET=1 before triton is "
            "first imported to run on CPU, or use backend='torch' / MLAKIT_DECODE=torch"
        )
    if dev.type != "cuda" and B > 0:  # cheap here; on GPU this check would sync the host
        _check(
            int(lengths.max()) <= capacity,
            f"lengths.max()={int(lengths.max())} exceeds cache capacity {capacity}",
        )

    out = torch.empty((B, H, r), dtype=q_lat.dtype, device=dev)
    lse = torch.empty((B, H), dtype=torch.float32, device=dev)
    if B == 0 or H == 0:
        return out, lse

    if num_splits is None:
        if _INTERPRET:
            num_splits = pick_num_splits(
                B, H, capacity, num_sms=2, min_split_tokens=_INTERPRET_MIN_SPLIT_TOKENS
            )
        else:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            num_splits = pick_num_splits(B, H, capacity, num_sms=sms, min_split_tokens=_MIN_SPLIT_TOKENS)
    _check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    if num_splits == 1:  # write the final result directly, no merge
        part_o, part_l = out.unsqueeze(2), lse.unsqueeze(2)  # (B, H, 1, r), (B, H, 1)
    else:
        part_o = torch.empty((B, H, num_splits, r), dtype=torch.float32, device=dev)
        part_l = torch.empty((B, H, num_splits), dtype=torch.float32, device=dev)

    has_rope = d_r > 0
    qr, kr = (q_rope, k_rope) if has_rope else (q_lat, c_kv)  # dummies, never read
    bt = block_table if paged else lengths
    st = starts if starts is not None else lengths
    page_size = c_kv.shape[1] if paged else 1
    block_r = max(16, triton.next_power_of_2(r))
    block_dr = max(16, triton.next_power_of_2(d_r)) if has_rope else 16
    split_len_hint = triton.next_power_of_2(max(1, math.ceil(capacity / num_splits)))
    args = (
        q_lat, qr, c_kv, kr, lengths, st, bt, part_o, part_l,
        float(scale), H, r, d_r, page_size, num_splits, split_len_hint,
        *q_lat.stride(), *qr.stride(), *c_kv.stride(), *kr.stride(),
        bt.stride(0), bt.stride(-1) if paged else 0,
        *part_o.stride(), *part_l.stride(),
    )  # fmt: skip
    consts = dict(
        HAS_ROPE=has_rope,
        HAS_STARTS=starts is not None,
        PAGED=paged,
        UPCAST=_INTERPRET,
        DOT_PREC="ieee" if q_lat.dtype == torch.float32 else "tf32",
        BLOCK_R=block_r,
        BLOCK_DR=block_dr,
    )
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        if _INTERPRET:  # one fixed config: autotuning in the interpreter would only cost time
            grid = (B, triton.cdiv(H, 16), num_splits)
            _mla_decode_split_kernel[grid](*args, **consts, BLOCK_H=16, BLOCK_N=16)
        else:
            grid = lambda meta: (B, triton.cdiv(H, meta["BLOCK_H"]), num_splits)  # noqa: E731
            _mla_decode_split_autotuned[grid](*args, **consts)
        if num_splits > 1:
            _mla_decode_merge_kernel[(B, H)](
                part_o, part_l, out, lse, r, num_splits,
                *part_o.stride(), *part_l.stride(), *out.stride(), *lse.stride(),
                BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_R=block_r,
            )  # fmt: skip
    return out, lse
