"""Calibrated choices of the rotary subspace (pure tensor math).

Methods, all restricted to one shared rope key of d_R dims so they are comparable:
- ``high``      MHA2MLA high-frequency: every head's components at the highest frequencies.
- ``uniform``   MHA2MLA uniform: frequencies spread evenly over the spectrum, all heads.
- ``norm``      MHA2MLA 2-norm: components with the largest query-norm x key-norm product.
- ``transmla``  TransMLA RoRoPE + FreqFold: PCA of the key heads per (folded) frequency
                group, the leading component(s) of every group kept.
- ``scored``    ours: RoRoPE mixing (folded or not), then keep the components whose loss of
                rotation would cost most, measured in output error: key energy x the energy
                of the queries that read the component x how far those heads look back at that
                frequency (calibrated attention lag profile). With folding, the phase error of
                rotating at one representative frequency is charged against the gain.

Every method but ``transmla`` is paired with the phase average (``averaged=True`` below): a dropped
component's unrotated query is scaled by the mean of its phase over the lags attended
(``LayerMetrics.phase_mean``, applied in ``mla_layer.convert_attention``), and its drop is charged the
phase's variance (``averaged_reach``) instead of its distance from lag 0 (``reach``).

``stock=True`` (scored and transmla) restricts a plan to the form stock DeepSeek-V3 code can
rotate: one component per group of ``fold`` frequencies, rotating at the group's first
(highest) frequency, so the kept frequencies are {0, k, 2k, ...} and one rope table with a
rescaled base reproduces them (see ``mlakit.export``). Which component each group keeps is
still the method's choice; the phase error of the fixed representative is charged for it.
"""

from __future__ import annotations

import torch

from ..choices import ROPE_METHODS, STOCK_ROPE_METHODS
from .layer_metrics import LayerMetrics
from .mla_layer import AttentionWeights, grouped_keys
from .rope_split import RopePlan, high_frequency_plan, identity_mixing

__all__ = [
    "ROPE_METHODS", "STOCK_ROPE_METHODS", "auto_fold", "check_stock_rope_dim", "component_costs", "key_group_covariance", "pca_mixing", "rope_error", "select_rope",
]



def check_stock_rope_dim(head_dim: int, rope_dim: int) -> None:
    """Stock form keeps every k-th frequency: d_R / 2 must divide head_dim / 2."""
    half, n_keep = head_dim // 2, rope_dim // 2
    if n_keep == 0 or half % n_keep:
        allowed = [2 * n for n in range(1, half + 1) if half % n == 0]
        raise ValueError(f"stock-form rope (for the deepseek-v3 export) keeps every k-th of the {half} rotary "
                         f"frequencies, so the rope dim must be one of {allowed}; got {rope_dim}")


def _stock_plan(U: torch.Tensor, gain: torch.Tensor, fold: int) -> RopePlan:
    """One component per group (the largest GAIN), rotating at the group's first frequency."""
    best = gain.argmax(dim=1)
    kept = [(int(best[g]), g) for g in range(U.shape[0])]
    return RopePlan(U, kept, [g * fold for g in range(U.shape[0])], fold)


def key_group_covariance(w: AttentionWeights, sigma: torch.Tensor, fold: int) -> torch.Tensor:
    """(groups, G*fold, G*fold) E[Re k Re k^T + Im k Im k^T] of each frequency group's components."""
    k = grouped_keys(w, fold)
    return torch.einsum("nahx,xy,nbhy->nab", k, sigma.double(), k)


def pca_mixing(cov: torch.Tensor) -> torch.Tensor:
    """Rows: eigenvectors of each group's covariance, by decreasing energy."""
    _, vecs = torch.linalg.eigh(cov)
    return vecs.flip(-1).transpose(-1, -2).contiguous()


def _group_weights(m: LayerMetrics, reach: torch.Tensor, G: int, fold: int, group: torch.Tensor) -> torch.Tensor:
    """(groups, G*fold): sum over query heads of KV head g of weight_i E|q_ij|^2 REACH[i, j]."""
    per_head = m.head_weight[:, None] * m.query_energy * reach  # (H, d/2)
    per_kv = torch.zeros(G, per_head.shape[1], dtype=torch.float64).index_add_(0, group, per_head)
    n_grp = per_kv.shape[1] // fold
    return per_kv.view(G, n_grp, fold).permute(1, 0, 2).reshape(n_grp, G * fold)


def _plan_from_costs(U, gain, rep, n_keep, fold):
    order = torch.argsort(gain.flatten(), descending=True)[:n_keep]
    n_comp = U.shape[1]
    kept = [(int(i) % n_comp, int(i) // n_comp) for i in order]
    freqs = [g * fold + int(rep[g, c]) for c, g in kept]
    return RopePlan(U, kept, freqs, fold)


def component_costs(U: torch.Tensor, fold: int, w: AttentionWeights, m: LayerMetrics,
                    cov: torch.Tensor | None = None, averaged: bool = True):
    """Predicted output error of each mixed component (groups, comps): ``drop`` if it loses its
    rotation (its query scaled by the phase mean when AVERAGED), ``keep[..., jl]`` if it rotates at the
    group's frequency jl instead of its own."""
    G, H = w.num_kv_heads, w.num_heads
    group = torch.arange(H) // (H // G)
    if cov is None:  # callers that already have key_group_covariance(w, m.sigma, fold) pass it
        cov = key_group_covariance(w, m.sigma, fold)
    energy = torch.einsum("nca,nab,ncb->nc", U, cov, U)  # E|m_c|^2
    u2 = U.square()  # (groups, comps, G*fold)
    drop_reach = m.averaged_reach(m.inv_freq) if averaged else m.reach(m.inv_freq)
    drop = energy * torch.einsum("nca,na->nc", u2, _group_weights(m, drop_reach, G, fold, group))
    theta = m.inv_freq.view(U.shape[0], fold)
    keep = []
    for star in range(fold):
        mismatch = (m.inv_freq - theta[:, star].repeat_interleave(fold)).abs()
        keep.append(energy * torch.einsum("nca,na->nc", u2, _group_weights(m, m.reach(mismatch), G, fold, group)))
    return drop, torch.stack(keep, dim=-1)


def rope_error(plan: RopePlan, w: AttentionWeights, m: LayerMetrics, averaged: bool = True) -> float:
    """Predicted output error of a plan: dropped components plus the phase error of kept ones."""
    drop, keep = component_costs(plan.mixing.double(), plan.fold, w, m, averaged=averaged)
    total = sum(float(drop[g, c]) for c, g in plan.dropped)
    total += sum(float(keep[g, c, j - g * plan.fold]) for (c, g), j in zip(plan.kept, plan.freq_index))
    return total


def _scored(w, m, n_keep, fold, mixing, stock=False):
    G = w.num_kv_heads
    cov = key_group_covariance(w, m.sigma, fold)
    U = pca_mixing(cov) if mixing == "pca" else identity_mixing(G, w.head_dim, fold)
    drop, keep = component_costs(U, fold, w, m, cov)
    if stock:
        return _stock_plan(U, drop - keep[..., 0], fold)
    best, rep = keep.min(dim=-1)
    return _plan_from_costs(U, drop - best, rep, n_keep, fold)


def auto_fold(half: int, n_keep: int) -> int:
    """Exact frequencies (fold 1) while more than half of them are kept: the dropped ones are the cheapest.
    Below that, the smallest divisor of d/2 that leaves no more frequency groups (d/2 / fold) than kept
    components, so that every group can keep one: a fold that leaves some groups none measured far worse
    than the rotary error model predicts (docs/results.md, "The fold rule"), and a larger fold only adds
    phase error to the kept components. The conversion measures the folds up to this one on the calibration
    data instead (``fold_choice``); the rule stands in where no layer is run (the whole-model bench helpers)."""
    if 2 * n_keep > half or n_keep == 0:
        return 1
    return next(f for f in range(1, half + 1) if half % f == 0 and half // f <= n_keep)


def transmla_fold(half: int, n_keep: int) -> int:
    """TransMLA's method's fold: the largest divisor of d/2 that still leaves at least N_KEEP groups. It was
    also mlakit's auto fold until the rule above replaced it; the baseline keeps it so that its rows stay
    comparable with every earlier measurement."""
    if n_keep >= half or n_keep == 0:
        return 1
    fold = half // n_keep
    while half % fold:
        fold -= 1
    return fold


def _transmla(w, m, n_keep, stock=False):
    G, half = w.num_kv_heads, w.head_dim // 2
    fold = transmla_fold(half, n_keep)
    cov = key_group_covariance(w, m.sigma, fold)
    U = pca_mixing(cov)
    energy = torch.einsum("nca,nab,ncb->nc", U, cov, U)
    if stock:
        return _stock_plan(U, energy, fold)
    n_grp = U.shape[0]
    per_group = -(-n_keep // n_grp)
    rank = torch.arange(U.shape[1])[None].expand(n_grp, -1)
    gain = torch.where(rank < per_group, energy + energy.max() * 1e3, energy)  # leading components first
    rep = U.square().view(n_grp, U.shape[1], G, fold).sum(2).argmax(-1)  # dominant frequency of each component
    return _plan_from_costs(U, gain, rep, n_keep, fold)


def select_rope(method: str, w: AttentionWeights, m: LayerMetrics, rope_dim: int, fold: int = 1,
                mixing: str = "pca", stock: bool = False) -> RopePlan:
    G, d = w.num_kv_heads, w.head_dim
    half, n_keep = d // 2, rope_dim // 2
    if stock:
        if method not in STOCK_ROPE_METHODS:
            raise ValueError(f"stock-form rope works with the rope methods {', '.join(STOCK_ROPE_METHODS)}, "
                             f"not {method!r}")
        check_stock_rope_dim(d, rope_dim)
        if fold != half // n_keep:
            raise ValueError(f"stock-form rope at rope dim {rope_dim} folds {half // n_keep} frequencies per group; "
                             f"got fold {fold} (use fold 0 = auto)")
    if method == "scored":
        if half % fold:
            raise ValueError(f"fold {fold} does not divide head_dim/2 = {half}")
        return _scored(w, m, n_keep, fold, mixing, stock)
    if method == "transmla":
        return _transmla(w, m, n_keep, stock)
    if method == "high":
        return high_frequency_plan(G, d, rope_dim)
    U = identity_mixing(G, d)
    if method == "uniform":
        n_freq = -(-n_keep // G) if n_keep else 0
        freqs = sorted({int(round(x)) for x in torch.linspace(0, half - 1, n_freq).tolist()}) if n_freq else []
        kept = [(g, j) for j in freqs for g in range(G)][:n_keep]
    elif method == "norm":
        group = torch.arange(w.num_heads) // (w.num_heads // G)
        q_norm = torch.zeros(G, half, dtype=torch.float64).index_add_(0, group, m.query_energy.sqrt())
        score = (q_norm * m.key_energy.sqrt()).T  # (d/2, G): index j * G + g
        order = torch.argsort(score.flatten(), descending=True)[:n_keep]
        kept = [(int(i) % G, int(i) // G) for i in order]
    else:
        raise ValueError(f"unknown rope method {method!r}; choose one of {ROPE_METHODS}")
    return RopePlan(U, kept, [j for _, j in kept], 1)
