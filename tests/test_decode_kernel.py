"""The Triton absorbed-decode kernel against the float32 torch reference, and the dispatch.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before any
import of triton). On a CUDA machine, ``TRITON_INTERPRET=0 pytest tests/test_decode_kernel.py``
runs the same grid through the compiled kernel on the GPU.

Tolerances (``assert_close`` checks ``|got - want| <= atol + rtol * |want|``), with the largest
largest absolute errors observed over the grid in the interpreter (``-s`` prints each case's):
- fp32: out atol=rtol=1e-5 (observed 1.9e-6), lse atol=rtol=1e-5 (observed 1.9e-6)
- bf16: out atol=rtol=2e-2 (observed 1.6e-2 = one bf16 ulp at |out| in [2, 4): probabilities and
  the output are rounded to bf16), lse atol=rtol=1e-4 (observed 9.5e-7: scores are fp32)
- fp16: out atol=rtol=2e-2 (observed 9.8e-4), lse atol=rtol=1e-4 (observed 1.4e-6)
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mlakit.kernels.decode_dispatch import mla_decode, resolve_backend  # noqa: E402
from mlakit.kernels.decode_reference import mla_decode_reference  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

TOL = {  # dtype -> (out atol, out rtol, lse atol, lse rtol)
    torch.float32: (1e-5, 1e-5, 1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2, 1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2, 1e-4, 1e-4),
}
GARBAGE = 1e3  # written into cache slots no valid token may read: a masking bug shows as a huge error


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> float:
    """Assert ``|got - want| <= atol + rtol*|want|`` elementwise; infinities must match exactly.

    Returns the worst absolute error over finite entries; the failure message names the worst
    element (by excess over the bound), its index and both values.
    """
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert not torch.isnan(got).any(), f"{name}: NaN at {torch.nonzero(torch.isnan(got))[0].tolist()}"
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_got, inf_want) or not torch.equal(got[inf_got], want[inf_want]):
        idx = torch.nonzero((inf_got != inf_want) | (inf_got & (got != want)))[0].tolist()
        raise AssertionError(
            f"{name}: infinity mismatch at {idx}: got {got[tuple(idx)]}, want {want[tuple(idx)]}"
        )
    fin = ~inf_want
    err = torch.where(fin, (got - want).abs(), torch.zeros_like(got))
    excess = err - (atol + rtol * torch.where(fin, want.abs(), torch.zeros_like(want)))
    worst = int(torch.argmax(excess)) if excess.numel() else 0
    if excess.numel() and excess.flatten()[worst] > 0:
        idx = list(torch.unravel_index(torch.tensor(worst), got.shape))
        idx = [int(i) for i in idx]
        raise AssertionError(
            f"{name}: worst error {err.flatten()[worst]:.3g} at {idx} (got {got.flatten()[worst]:.6g}, "
            f"want {want.flatten()[worst]:.6g}) exceeds atol={atol:g} + rtol={rtol:g}*|want|; "
            f"max abs error {err.max():.3g}"
        )
    return float(err.max()) if err.numel() else 0.0


def make_case(B, H, r, d_r, lengths, dtype, paged=False, page_size=16, starts=None, strided=False, seed=0):
    """Random inputs; cache slots outside [starts, lengths) hold GARBAGE. Returns (args, kwargs)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    if starts is not None:
        starts = torch.tensor(starts, dtype=torch.int64)
    s_max = int(lengths.max()) + 5

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    q_lat, q_rope = rnd(B, H, r), rnd(B, H, d_r)
    pos = torch.arange(s_max)
    invalid = pos[None, :] >= lengths[:, None].long()  # (B, S)
    if starts is not None:
        invalid |= pos[None, :] < starts[:, None]
    # the combined (B, S, r + d_R) layout: c_kv and k_rope are views with a row stride of r + d_R
    kv = rnd(B, s_max, r + d_r).masked_fill(invalid[..., None], GARBAGE)
    block_table = None
    if paged:
        n_pages = -(-s_max // page_size)
        total = B * n_pages + 3  # a few pages no row owns
        perm = torch.randperm(total, generator=g)[: B * n_pages].view(B, n_pages).to(torch.int32)
        pages = torch.full((total, page_size, r + d_r), GARBAGE)
        padded = torch.full((B, n_pages * page_size, r + d_r), GARBAGE)
        padded[:, :s_max] = kv
        pages[perm.long()] = padded.view(B, n_pages, page_size, r + d_r)
        kv, block_table = pages, perm
    c_kv, k_rope = kv[..., :r], kv[..., r:]  # views with row stride r + d_R
    if strided:  # like the model's cache[:, 0] of a (B, 1, S, r) buffer, with a batch stride of 2*S*r
        buf = torch.full((kv.shape[0], 2, kv.shape[1], r), GARBAGE)
        buf[:, 1] = c_kv
        c_kv = buf[:, 1]
    cast = [t.to(dtype).to(DEVICE) for t in (q_lat, q_rope, c_kv, k_rope)]
    scale = 2.0 / (r + d_r) ** 0.5  # peakier than 1/sqrt(d) so the max-subtraction matters
    kwargs = {
        "block_table": None if block_table is None else block_table.to(DEVICE),
        "starts": None if starts is None else starts.to(DEVICE),
    }
    return (*cast, lengths.to(DEVICE), scale), kwargs


# (B, H, r, d_R, lengths, dtype, paged, page_size, starts, strided, num_splits); num_splits None = heuristic.
# starts include start == length (a row emptied by left padding) and start == length - 1.
# Covers every value of every axis; lengths include 0, 1, multiples of the 16-token tile and
# not; num_splits 1 (direct write), several, and more splits than tiles (empty splits).
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    (1, 1, 16, 0, [1], F32, False, 0, None, False, None),
    (1, 9, 88, 16, [37], F32, False, 0, None, False, None),
    (3, 16, 160, 32, [0, 1, 70], F32, False, 0, [0, 0, 13], False, None),
    (3, 9, 512, 64, [45, 0, 33], BF16, False, 0, [45, 0, 7], False, None),
    (1, 16, 512, 64, [100], BF16, True, 16, None, False, None),
    (3, 1, 88, 0, [17, 1, 0], F32, True, 8, [5, 1, 0], False, 3),
    (3, 16, 88, 64, [63, 64, 65], BF16, True, 32, [16, 0, 33], False, None),
    (1, 9, 160, 16, [20], BF16, True, 16, None, False, 8),
    (3, 9, 16, 32, [5, 16, 31], BF16, False, 0, None, True, 1),
    (1, 16, 16, 64, [50], F32, True, 1, [17], False, 2),
    (3, 1, 512, 0, [1, 0, 90], BF16, False, 0, None, False, None),
    (1, 1, 512, 32, [33], F32, True, 64, None, True, 1),
    (3, 16, 512, 16, [80, 2, 48], F32, True, 16, [79, 1, 0], False, 4),
    (1, 9, 88, 0, [19], BF16, False, 0, None, True, 5),
    (3, 9, 160, 64, [0, 0, 0], F32, False, 0, None, False, 2),
    (1, 16, 160, 0, [0], BF16, True, 16, [0], False, None),
    (3, 9, 88, 32, [29, 47, 3], F16, False, 0, [3, 47, 2], True, None),
    (1, 16, 512, 64, [300], BF16, False, 0, None, True, None),
    (3, 16, 512, 64, [47, 130, 64], BF16, True, 16, [20, 100, 63], True, 3),
    (3, 9, 160, 16, [17, 33, 1], F32, True, 8, None, True, 1),
    (1, 1, 88, 64, [15], BF16, False, 0, None, False, 2),
    (3, 1, 16, 16, [2, 3, 4], BF16, True, 4, [1, 3, 0], False, None),
    (1, 9, 512, 0, [64], F32, False, 0, [31], False, 1),
    (3, 16, 16, 0, [31, 0, 16], F16, True, 16, None, False, 2),
]


def _case_id(case):
    B, H, r, d_r, lengths, dtype, paged, page, starts, strided, splits = case
    layout = f"paged{page}" if paged else "contig"
    extra = ("-starts" if starts is not None else "") + "-strided" * strided
    return f"B{B}H{H}r{r}dR{d_r}-{str(dtype)[6:]}-{layout}{extra}-s{splits}-L{'_'.join(map(str, lengths))}"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_triton_matches_reference(case):
    from mlakit.kernels.decode_triton import mla_decode_triton

    B, H, r, d_r, lengths, dtype, paged, page, starts, strided, splits = case
    args, kwargs = make_case(
        B, H, r, d_r, lengths, dtype, paged=paged, page_size=page, starts=starts, strided=strided
    )
    out, lse = mla_decode_triton(*args, **kwargs, num_splits=splits)
    want_out, want_lse = mla_decode_reference(*args, **kwargs)
    assert out.dtype == dtype and lse.dtype == torch.float32
    o_atol, o_rtol, l_atol, l_rtol = TOL[dtype]
    e_out = assert_close("out", out, want_out, o_atol, o_rtol)
    e_lse = assert_close("lse", lse, want_lse, l_atol, l_rtol)
    print(f"{_case_id(case)}: out err {e_out:.2e} (atol {o_atol:g}), lse err {e_lse:.2e} (atol {l_atol:g})")
    empty = torch.as_tensor(lengths) <= (torch.as_tensor(starts) if starts is not None else 0)
    assert torch.all(out[empty.to(out.device)] == 0) and torch.all(lse[empty.to(lse.device)] == float("-inf"))


@needs_triton
def test_split_count_does_not_change_result():
    from mlakit.kernels.decode_triton import mla_decode_triton

    args, kwargs = make_case(
        3, 9, 88, 16, [40, 7, 61], torch.float32, paged=True, page_size=8, starts=[0, 3, 20]
    )
    base_out, base_lse = mla_decode_triton(*args, **kwargs, num_splits=1)
    for splits in (2, 5, 16):
        out, lse = mla_decode_triton(*args, **kwargs, num_splits=splits)
        assert_close(f"out splits={splits}", out, base_out, 1e-5, 1e-5)
        assert_close(f"lse splits={splits}", lse, base_lse, 1e-5, 1e-5)


@needs_triton
def test_int64_metadata_and_int32_starts():
    from mlakit.kernels.decode_triton import mla_decode_triton

    args, kwargs = make_case(
        3, 9, 88, 16, [40, 7, 61], torch.bfloat16, paged=True, page_size=8, starts=[0, 3, 20]
    )
    want_out, want_lse = mla_decode_reference(*args, **kwargs)
    *head, lengths, scale = args
    kwargs = {"block_table": kwargs["block_table"].long(), "starts": kwargs["starts"].int()}
    out, lse = mla_decode_triton(*head, lengths.long(), scale, **kwargs)
    assert_close("out", out, want_out, *TOL[torch.bfloat16][:2])
    assert_close("lse", lse, want_lse, *TOL[torch.bfloat16][2:])


@needs_triton
def test_wrapper_errors_say_how_to_fix():
    from mlakit.kernels import decode_triton

    args, kwargs = make_case(1, 9, 16, 16, [5], torch.float32)
    q_lat, q_rope, c_kv, k_rope, lengths, scale = args
    with pytest.raises(ValueError, match="cast with .to"):
        decode_triton.mla_decode_triton(q_lat, q_rope, c_kv.to(torch.bfloat16), k_rope, lengths, scale)
    with pytest.raises(ValueError, match="k_rope must be"):
        decode_triton.mla_decode_triton(q_lat, q_rope, c_kv, k_rope[..., :8], lengths, scale)
    with pytest.raises(ValueError, match="lengths must be"):
        decode_triton.mla_decode_triton(q_lat, q_rope, c_kv, k_rope, lengths.float(), scale)
    with pytest.raises(ValueError, match="pass block_table"):
        decode_triton.mla_decode_triton(
            q_lat, q_rope, c_kv.expand(2, -1, -1), k_rope.expand(2, -1, -1), lengths, scale
        )
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="exceeds cache capacity"):
            decode_triton.mla_decode_triton(q_lat, q_rope, c_kv, k_rope, lengths + 100, scale)


def test_missing_triton_raises_clear_error(monkeypatch):
    from mlakit.kernels import decode_triton

    monkeypatch.setattr(decode_triton, "TRITON_AVAILABLE", False)
    args, kwargs = make_case(1, 1, 16, 0, [3], torch.float32)
    with pytest.raises(RuntimeError, match="MLAKIT_DECODE=torch"):
        decode_triton.mla_decode_triton(*args, **kwargs)


def test_pick_num_splits():
    from mlakit.kernels.decode_triton import pick_num_splits

    assert pick_num_splits(1, 16, 32768, num_sms=132, min_split_tokens=256) == 64  # capped
    assert pick_num_splits(64, 128, 32768, num_sms=132, min_split_tokens=256) == 1  # grid already full
    assert pick_num_splits(1, 16, 300, num_sms=132, min_split_tokens=256) == 2  # >= 256 tokens a split
    assert pick_num_splits(4, 16, 0, num_sms=132, min_split_tokens=256) == 1


@needs_triton
def test_autotune_prune_rule():
    from mlakit.kernels import decode_triton

    def kept(dtype, heads, split_len, block_r=512):
        named = {"H": heads, "split_len_hint": split_len, "CKV": torch.empty(1, dtype=dtype)}
        cfgs = decode_triton.prune_configs(decode_triton.AUTOTUNE_CONFIGS, named, BLOCK_R=block_r)
        return {(c.kwargs["BLOCK_H"], c.kwargs["BLOCK_N"], c.num_warps) for c in cfgs}

    big = kept(torch.bfloat16, 128, 4096)
    assert (16, 16, 4) in big and (32, 32, 8) in big
    assert (32, 32, 4) not in big and all(bn <= 32 for _, bn, _ in big)  # would spill at r=512
    assert all(bh == 16 for bh, _, _ in kept(torch.bfloat16, 9, 4096))  # no half-empty head tiles
    assert all(bn == 16 for _, bn, _ in kept(torch.bfloat16, 16, 8))  # short splits: small tiles
    assert kept(torch.float32, 16, 4096) == {(16, 16, 8)}  # fp32 keeps the smallest tiles only
    assert kept(torch.float32, 128, 4096, block_r=1 << 14)  # never empty: falls back to one config


def test_dispatch_torch_equals_reference():
    args, kwargs = make_case(
        3, 9, 88, 16, [0, 1, 40], torch.float32, paged=True, page_size=8, starts=[0, 3, 20]
    )
    got = mla_decode(*args, **kwargs, backend="torch")
    want = mla_decode_reference(*args, **kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_triton
def test_dispatch_triton_backend_matches_reference():
    args, kwargs = make_case(3, 9, 88, 16, [0, 1, 40], torch.bfloat16, starts=[0, 3, 20])
    out, lse = mla_decode(*args, **kwargs, backend="triton")
    want_out, want_lse = mla_decode_reference(*args, **kwargs)
    assert_close("out", out, want_out, *TOL[torch.bfloat16][:2])
    assert_close("lse", lse, want_lse, *TOL[torch.bfloat16][2:])


def test_bad_backend_env_raises(monkeypatch):
    monkeypatch.setenv("MLAKIT_DECODE", "cuda-please")
    with pytest.raises(ValueError, match="MLAKIT_DECODE"):
        resolve_backend(torch.device("cpu"))
    args, kwargs = make_case(1, 1, 16, 0, [3], torch.float32)
    with pytest.raises(ValueError, match="not one of"):
        mla_decode(*args, **kwargs)


def test_auto_backend_is_torch_on_cpu(monkeypatch):
    monkeypatch.delenv("MLAKIT_DECODE", raising=False)
    assert resolve_backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("MLAKIT_DECODE", "AUTO")
    assert resolve_backend(torch.device("cpu")) == "torch"
    assert resolve_backend(torch.device("cpu"), backend="triton") == "triton"
