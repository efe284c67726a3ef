"""Second-moment quantities of one layer, all linear images of E[x~ x~^T] (pure tensor math).

Error model (first order in the attention): a logit error e on key s moves head i's output by
p_s e (v_s - o), so E||dout||^2 ~ scale^2 * E[sum_s p_s^2 e_s^2] * out_i with
out_i = E||W_O,i (v - E v)||^2; a value error e_v moves it by p_s W_O,i e_v. Every error below
is in these units (squared residual-stream output), so the RoPE split, the low-rank step and
the rank planner trade them against each other directly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .block_metric import BlockMetric
from .calibration import LayerStats
from .mla_layer import AttentionWeights

__all__ = ["LayerMetrics", "layer_metrics", "metrics_from_tensors", "metrics_tensors", "psd_factor", "psd_power",
           "psd_powers"]


@dataclass
class LayerMetrics:
    sigma: torch.Tensor  # (X, X) E[x~ x~^T], X = D+1
    query_energy: torch.Tensor  # (H, d/2) E|q_ij|^2
    key_energy: torch.Tensor  # (G, d/2) E|k_gj|^2
    head_weight: torch.Tensor  # (H,) scale^2 * out_i: output^2 per unit of squared logit error
    rho: torch.Tensor  # (H,) E[sum_s p_s^2]
    lag_p2: torch.Tensor  # (H, L) E[p^2] by lag
    inv_freq: torch.Tensor  # (d/2,)
    query_moment: torch.Tensor  # (H, d, d) E[q_i q_i^T] (unrotated)
    value_metric: torch.Tensor  # (G, d, d) sum over heads i of group g of rho_i W_O,i^T W_O,i
    scale: float
    sensitivity: float | None = None  # KL per unit of squared output error, x2 (calibration.LayerStats)
    _sigma_half: torch.Tensor | None = None

    @property
    def sigma_half(self) -> torch.Tensor:
        """A square-root factor R of sigma, R R^T = sigma + eps I with a small ridge eps
        (``psd_factor``): every use (the low-rank step, the rank planner) depends on R R^T alone,
        so the Cholesky factor serves, at about a tenth of the cost of the symmetric square root
        at D + 1 = 4097."""
        if self._sigma_half is None:
            self._sigma_half = psd_factor(self.sigma)
        return self._sigma_half

    def reach(self, freq: torch.Tensor) -> torch.Tensor:
        """(H, n) E[sum_s p_s^2 (1 - cos(freq * lag))]: the weight of a phase error growing at FREQ."""
        return self.lag_p2 @ (1 - torch.cos(self._lag_angles(freq)))

    def _lag_angles(self, freq: torch.Tensor) -> torch.Tensor:
        """(L, n) the angle FREQ turns through at each lag of the profile."""
        lags = torch.arange(self.lag_p2.shape[1], dtype=torch.float64)
        return lags[:, None] * freq.double()[None]

    def phase_mean(self, freq: torch.Tensor) -> torch.Tensor:
        """(H, n) complex: the mean of exp(i freq lag) over the lags each head's attention weighs,
        E[sum_s p_s^2 exp(i freq lag_s)] / E[sum_s p_s^2]. A dropped component's score term is
        Re(z exp(i freq lag)); its query scaled by this mean gives the position-free term nearest to it
        in the error model's weighting (the conditional mean: near 1 for a frequency that barely turns
        within the lags attended, near 0 for one whose phase the lags scatter)."""
        angle = self._lag_angles(freq)
        p2 = self.lag_p2.double()
        total = torch.complex(p2 @ torch.cos(angle), p2 @ torch.sin(angle))
        return total / self.rho.double()[:, None].clamp_min(1e-300)

    def averaged_reach(self, freq: torch.Tensor) -> torch.Tensor:
        """(H, n) ``reach`` when the dropped component's query takes ``phase_mean``: half the weighted
        variance of exp(i freq lag), (E sum p^2 - |E sum p^2 exp(i freq lag)|^2 / E sum p^2) / 2, which is
        at most ``reach`` (the mean beats 1 as a position-free stand-in)."""
        return 0.5 * self.rho[:, None] * (1 - self.phase_mean(freq).abs().square())

    def dropped_query_map(self) -> torch.Tensor:
        """(H, d, d): the map that multiplies each head's unrotated query at every frequency j by
        ``phase_mean`` (rows j and j + d/2 are its real and imaginary parts), as a real block matrix."""
        mean = self.phase_mean(self.inv_freq)  # (H, d/2)
        H, n = mean.shape
        j = torch.arange(n)
        out = torch.zeros(H, 2 * n, 2 * n, dtype=torch.float64)
        out[:, j, j] = out[:, j + n, j + n] = mean.real
        out[:, j, j + n] = -mean.imag
        out[:, j + n, j] = mean.imag
        return out


def metrics_tensors(m: LayerMetrics) -> dict[str, torch.Tensor]:
    """M as a flat dict of CPU tensors (for ``torch.save``): its fields without the cached square
    root (recomputed where needed) and without the sensitivity, which the planner carries."""
    out = {f.name: getattr(m, f.name).cpu() for f in fields(m)
           if isinstance(getattr(m, f.name), torch.Tensor) and f.name != "_sigma_half"}
    return out | {"scale": torch.tensor(m.scale, dtype=torch.float64)}


def metrics_from_tensors(t: dict[str, torch.Tensor], device: str = "cpu") -> LayerMetrics:
    """The inverse of ``metrics_tensors`` (other keys in T are ignored), its tensors on DEVICE."""
    names = {f.name for f in fields(LayerMetrics)} - {"scale"}
    return LayerMetrics(**{k: v.to(device) for k, v in t.items() if k in names}, scale=float(t["scale"]))


def psd_power(m, power: float, rel_eps: float = 1e-12):
    """Symmetric PSD matrix to a real power, eigenvalues floored at rel_eps * max."""
    return psd_powers(m, (power,), rel_eps)[0]


def psd_powers(m, powers: tuple[float, ...], rel_eps: float = 1e-12) -> list:
    """``psd_power`` for several powers from one eigendecomposition (the costly part at hidden 4096).
    A BlockMetric is taken block by block (same floor, same result) and stays one."""
    if isinstance(m, BlockMetric):
        return m.powers(powers, rel_eps)
    vals, vecs = torch.linalg.eigh(m.double())
    floor = vals.max().clamp_min(1e-300) * rel_eps
    vals = vals.clamp_min(floor)
    return [(vecs * vals.pow(p)) @ vecs.T for p in powers]


# Ridges tried in turn by psd_factor, relative to ||m||_F. The last is the rounding level of a
# calibration second moment (float32 products summed in float64: entries carry a relative error
# near 1e-6 of their terms' magnitudes), so no shift tried exceeds what that matrix already carries.
_CHOLESKY_RIDGES = (1.0, 1e3, 1e6)


def psd_factor(m: torch.Tensor, rel_eps: float = 1e-12) -> torch.Tensor:
    """A factor L of a symmetric PSD matrix, L L^T = m + eps I: the Cholesky factor, with eps the
    first of rel_eps * ||m||_F times 1, 1e3, 1e6 at which m + eps I is numerically positive definite
    (the first is at least the ``psd_power`` floor, rel_eps * max eigenvalue). A rank-deficient m,
    such as the second moment of fewer calibration tokens than it has columns, needs the larger
    ridges. Where none serves, the floored symmetric square root ``psd_power(m, 0.5)``, an
    eigendecomposition about ten times the cost at 4097 columns."""
    m = m.double()
    norm = float(torch.linalg.matrix_norm(m))
    for ridge in _CHOLESKY_RIDGES:
        shifted = m.clone()
        shifted.diagonal().add_(max(rel_eps * ridge * norm, 1e-300))
        factor, info = torch.linalg.cholesky_ex(shifted)
        del shifted
        if int(info) == 0:
            return factor
    return psd_power(m, 0.5, rel_eps)


def _complex_energy(row_energy: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """(n, d/2) |.|^2 of each complex component from the energies of its rows (re, im halves)."""
    return row_energy.view(n, 2, d // 2).sum(1)


def layer_metrics(w: AttentionWeights, stats: LayerStats) -> LayerMetrics:
    H, G, d = w.num_heads, w.num_kv_heads, w.head_dim
    sigma = stats.sigma.double()
    scale = d**-0.5
    q, k, v, o = w.q.double(), w.k.double(), w.v.double(), w.o.double()
    qm = q.view(H, d, -1)
    query_moment = torch.einsum("hax,xy,hby->hab", qm, sigma, qm)  # (H, d, d)
    query_energy = torch.diagonal(query_moment, dim1=1, dim2=2).reshape(H, 2, d // 2).sum(1)
    key_energy = _complex_energy(((k @ sigma) * k).sum(1), G, d)  # diag(k sigma k^T) only
    vm = v.view(G, d, -1)
    mean_v = vm @ sigma[:, -1]  # (G, d): E v, since the last column of sigma is E[x~]
    cov_v = torch.einsum("gax,xy,gby->gab", vm, sigma, vm) - mean_v[:, :, None] * mean_v[:, None, :]
    group = torch.arange(H) // (H // G)
    o_heads = o.view(o.shape[0], H, d).permute(1, 0, 2)  # (H, D, d): W_O,i
    oto = o_heads.transpose(1, 2) @ o_heads  # (H, d, d)
    out = torch.einsum("hab,hba->h", oto, cov_v[group])
    rho = stats.lag_p2.double().sum(1)
    value_metric = torch.zeros(G, d, d, dtype=torch.float64).index_add_(0, group, rho[:, None, None] * oto)
    return LayerMetrics(
        sigma=sigma,
        query_energy=query_energy,
        key_energy=key_energy,
        head_weight=scale**2 * out,
        rho=rho,
        lag_p2=stats.lag_p2.double(),
        inv_freq=stats.inv_freq.double(),
        query_moment=query_moment,
        value_metric=value_metric,
        scale=scale,
        sensitivity=stats.sensitivity,
    )
