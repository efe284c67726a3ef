"""How much of each layer's key and value error weight lies on the mean input: E||W mu||^2 in the output
metric the low-rank step uses (keys: the query moments by head weight; values: W_O), over the same under
E[x x^T]. A key offset that is the same at every position cancels in the softmax, so a large key share
means the metric spends weight where no score changes (bench/experiments/centred_keys.py asks whether the
latent gains by ignoring it).

    python bench/experiments/key_mean_share.py     # SmolLM2-135M, 16 x 512 builtin calibration
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlakit.arch.families import attention_shape  # noqa: E402
from mlakit.convert.assemble import read_attention  # noqa: E402
from mlakit.convert.layer_metrics import layer_metrics  # noqa: E402
from mlakit.io.source import open_source  # noqa: E402
from mlakit.pipeline.api import ConvertOptions  # noqa: E402
from mlakit.pipeline.whole_model import calibrate  # noqa: E402

source = open_source("default")
shape = attention_shape(source.config)
opts = ConvertOptions(calib_samples=16, calib_seq_len=512, kv_budget=0.3125, quiet=True)
stats = calibrate(source, shape, opts)
for i, st in enumerate(stats):
    w = read_attention(source, i, shape)
    m = layer_metrics(w, st)
    S = m.sigma
    mu = S[:, -1]  # E[x~]: sigma's last column
    H, G, d = w.num_heads, w.num_kv_heads, w.head_dim
    k, v = w.k.double().view(G, d, -1), w.v.double().view(G, d, -1)
    grp = torch.arange(H) // (H // G)
    qg = torch.zeros(G, d, d, dtype=torch.float64).index_add_(0, grp, (m.head_weight * m.rho)[:, None, None] * m.query_moment)
    kS, kmu = torch.einsum("gax,xy,gby->gab", k, S, k), torch.einsum("gax,x->ga", k, mu)
    key_share = float(torch.einsum("gab,ga,gb->", qg, kmu, kmu) / torch.einsum("gab,gba->", qg, kS))
    vS, vmu = torch.einsum("gax,xy,gby->gab", v, S, v), torch.einsum("gax,x->ga", v, mu)
    val_share = float(torch.einsum("gab,ga,gb->", m.value_metric, vmu, vmu) / torch.einsum("gab,gba->", m.value_metric, vS))
    xs = float(mu[:-1].square().sum() / S.diagonal()[:-1].sum())
    print(f"layer {i:2d} |mu|^2/E|x|^2 {xs:.3f}  key mean share {key_share:.3f}  value mean share {val_share:.3f}", flush=True)
