"""What one layer's keys and values look like to the converter (pure tensor math, float64).

Everything is a linear image of the calibration second moment Sigma = E[x~ x~^T]; no
activation is needed:

- spectra: eigenvalues of W Sigma W^T for W = W_k (G*d rows), W_v (G*d) and the stacked
  [W_k; W_v] (2*G*d). The number of leading directions holding 90% / 99% of that energy is
  how small a plain PCA latent of the keys, the values, or both could be.
- rotary: per frequency j, each KV head's key energy E|k_gj|^2; after RoRoPE mixing (PCA of
  the G heads' components at j; TransMLA, Meng et al. 2025, arXiv:2502.07864) the share of the
  energy in the leading mixed component, and the predicted output error of dropping each mixed
  component's rotation (``rope_select.component_costs``).
- latent target: for a planned (d_R, r), the share of the energy of y = [dropped rotary
  components; v] in its top r directions, the best any rank-r latent could keep of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compress import Method, layer_plan
from .layer_metrics import LayerMetrics
from .mla_layer import AttentionWeights, nope_value_map
from .rope_select import component_costs, key_group_covariance, pca_mixing

__all__ = [
    "LayerSpectra",
    "RotarySpectrum",
    "dims_for_energy",
    "energy_spectrum",
    "latent_energy_kept",
    "layer_spectra",
    "rotary_spectrum",
    "spectra_summary",
]

_TINY = 1e-300


@dataclass
class RotarySpectrum:
    key_energy: torch.Tensor  # (G, d/2) E|k_gj|^2 per KV head and frequency
    mixed_energy: torch.Tensor  # (d/2, G) energy of the RoRoPE-mixed components, descending per frequency
    drop_cost: torch.Tensor  # (d/2, G) predicted output error if that mixed component stops rotating

    @property
    def lead_fraction(self) -> torch.Tensor:
        """(d/2,) share of each frequency's key energy in its leading mixed component."""
        return self.mixed_energy[:, 0] / self.mixed_energy.sum(1).clamp_min(_TINY)

    @property
    def lead_energy_share(self) -> float:
        """Share of all key energy in the leading mixed component of every frequency (1/G = no gain)."""
        return float(self.mixed_energy[:, 0].sum() / self.mixed_energy.sum().clamp_min(_TINY))

    @property
    def lead_cost_share(self) -> float:
        """Share of the total drop cost carried by the leading mixed components."""
        return float(self.drop_cost[:, 0].sum() / self.drop_cost.sum().clamp_min(_TINY))


@dataclass
class LayerSpectra:
    k: torch.Tensor  # (G*d,) eigenvalues of W_k Sigma W_k^T, descending
    v: torch.Tensor  # (G*d,)
    kv: torch.Tensor  # (2*G*d,) of the stacked [W_k; W_v]
    rotary: RotarySpectrum


def energy_spectrum(w: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of W Sigma W^T, descending and >= 0, for a map W (n, D+1): the energy of W x~ by direction."""
    w = w.double()
    cov = w @ sigma.double() @ w.T  # (n, n)
    return torch.linalg.eigvalsh((cov + cov.T) / 2).flip(0).clamp_min(0)


def dims_for_energy(eigenvalues: torch.Tensor, fraction: float) -> int:
    """Fewest leading directions whose energy reaches FRACTION of the total (0 when there is no energy)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"energy fraction must be in (0, 1]; got {fraction}")
    total = eigenvalues.sum()
    if total <= 0:
        return 0
    cum = eigenvalues.double().cumsum(0) / total
    n = int(torch.searchsorted(cum, torch.tensor([fraction - 1e-12], dtype=torch.float64))[0]) + 1
    return min(n, eigenvalues.shape[0])


def rotary_spectrum(w: AttentionWeights, m: LayerMetrics) -> RotarySpectrum:
    """Per-frequency key energy before and after RoRoPE mixing (fold = 1, exact), with drop costs."""
    cov = key_group_covariance(w, m.sigma, fold=1)  # (d/2, G, G)
    U = pca_mixing(cov)  # rows: mixed components by decreasing energy
    mixed = torch.einsum("nca,nab,ncb->nc", U, cov, U).clamp_min(0)  # (d/2, G)
    drop, _ = component_costs(U, 1, w, m, cov)
    return RotarySpectrum(key_energy=m.key_energy.double(), mixed_energy=mixed, drop_cost=drop.clamp_min(0))


def layer_spectra(w: AttentionWeights, m: LayerMetrics) -> LayerSpectra:
    return LayerSpectra(
        k=energy_spectrum(w.k, m.sigma),
        v=energy_spectrum(w.v, m.sigma),
        kv=energy_spectrum(torch.cat([w.k, w.v], dim=0), m.sigma),
        rotary=rotary_spectrum(w, m),
    )


def latent_energy_kept(
    w: AttentionWeights, m: LayerMetrics, method: Method, rope_dim: int, rank: int
) -> float:
    """Share of the energy of y = [dropped rotary components; v] in its top RANK directions, for the
    rotary split METHOD picks at ROPE_DIM: an upper bound on what a rank-RANK latent keeps of y."""
    eig = energy_spectrum(nope_value_map(w, layer_plan(w, m, method, rope_dim)), m.sigma)
    return float(eig[:rank].sum() / eig.sum().clamp_min(_TINY))


def _round(x, digits: int):
    return [_round(v, digits) for v in x] if isinstance(x, list) else float(f"{x:.{digits}g}")


def _floats(t: torch.Tensor, digits: int = 6):
    """A tensor as (nested) lists of floats rounded to DIGITS significant digits."""
    return _round(t.double().tolist(), digits)


def spectra_summary(s: LayerSpectra, thresholds: tuple[float, ...] = (0.9, 0.99)) -> dict:
    """JSON-ready summary of one layer: dims per energy threshold, spectra and rotary arrays."""

    def part(eig: torch.Tensor) -> dict:
        return {
            "dims": {f"{t:g}": dims_for_energy(eig, t) for t in thresholds},
            "total_energy": _floats(eig.sum()),
            "eigenvalues": _floats(eig),
        }

    r = s.rotary
    return {
        "k": part(s.k),
        "v": part(s.v),
        "kv": part(s.kv),
        "rotary": {
            "lead_energy_share": round(r.lead_energy_share, 6),
            "lead_cost_share": round(r.lead_cost_share, 6),
            "lead_fraction": _floats(r.lead_fraction),  # (d/2,)
            "key_energy": _floats(r.key_energy),  # (G, d/2)
            "mixed_energy": _floats(r.mixed_energy),  # (d/2, G)
            "drop_cost": _floats(r.drop_cost),  # (d/2, G)
        },
    }
