"""Each layer's d_R judged by what its attention error costs the model's output, not by the error itself.

    cd bench && python experiments/rope_dim_fisher.py --source /tmp/qwen2-small --kv-budget 0.125
    cd bench && python experiments/rope_dim_fisher.py --source default --kv-budget 0.3125 --candidates 16,24,32,40,48,56,64

``--rope-dim measured-per-layer`` gives each layer the d_R of least held-out attention error, sum ||a' - a||^2.
On the trained Qwen2-style model at 87.5% that gave layer 0 d_R 8 where the model's perplexity prefers 16
(docs/results.md, "d_R per layer, converted"): the error's size does not say what it costs the layers above.
To second order, an error e_t added to the residual stream at token t raises the expected KL of the model's
next-token distribution by e_t^T F_t e_t / 2, F_t the Fisher of that distribution with respect to the residual
stream there. With labels y_t drawn from the model's own prediction, F_t = E[g_t g_t^T], g_t the gradient of
-log p(y_t) with respect to the attention's output at layer l, token t: so sum_t (g_t . e_t)^2 estimates twice the
KL the layer's error alone adds, through everything above it (linearised). Every layer is converted at each
candidate as ``--rope-dim measured`` converts it (the fold measured, the latent at the uniform rank, the value
refit on the first --held calibration sequences; ``rope_dim_measured.refit_at``), and measured on the next --held
calibration sequences (held out), on the source stream:

- ``error``: the relative attention error, what measured-per-layer reads (here on held-out sequences);
- ``fisher``: sum_t (g_t . e_t)^2 / sum_t (g_t . a_t)^2, the Fisher-weighted error relative to the same weighting
  of the source attention's output a_t;
- ``fisher GPL-3``: the same on the GPL-3 licence, printed to check the rule, never read by it;
- ``mean F`` and ``diag F``: the error weighted by the token-averaged Fisher F = mean_t g_t g_t^T of the fit
  sequences, whole and its diagonal only (a metric a conversion can keep per layer, where the per-token pairing
  of g and e is lost), relative to the same weighting of a.

Printed: each layer's values per candidate and each measure's per-layer choice; then the sums, where ``fisher``
summed over layers unnormalised (``kl``) is the linearised KL of converting every layer at that shared d_R.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "experiments"))
from fold_measured import attention, source_layers  # noqa: E402
from rope_dim_measured import add_arguments, refit_at, setup  # noqa: E402
from rope_dim_shift import text_ids  # noqa: E402

from mlakit.convert.calibration import BATCH_SIZE  # noqa: E402
from mlakit.pipeline.api import calibration_ids  # noqa: E402


def attention_gradients(source, ids: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Per layer, g (sequences, tokens, hidden): the gradient of sum_t -log p(y_t) with respect to the layer's
    attention output, y_t drawn from the source's own prediction at t (SEED)."""
    model = source.load_model(torch.float32).requires_grad_(False)
    layers = model.model.layers
    generator = torch.Generator().manual_seed(seed)
    grads = [[] for _ in layers]
    for batch in ids.split(BATCH_SIZE):
        outs = []

        def keep(module, args, out):
            value = out[0] if isinstance(out, tuple) else out
            value.retain_grad()
            outs.append(value)

        hooks = [layer.self_attn.register_forward_hook(keep) for layer in layers]
        try:
            embeds = model.get_input_embeddings()(batch).requires_grad_()
            logits = model(inputs_embeds=embeds, use_cache=False).logits.flatten(0, 1)
            with torch.no_grad():
                labels = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
            torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
        finally:
            for h in hooks:
                h.remove()
        for k, out in enumerate(outs):
            grads[k].append(out.grad.detach())
    return [torch.cat(g) for g in grads]


def fisher_error(g: torch.Tensor, converted: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """(sum_t (g_t . e_t)^2, sum_t (g_t . a_t)^2) for e = CONVERTED - TARGET, a = TARGET."""
    g = g.double()
    err = float(((converted - target).double() * g).sum(-1).square().sum())
    ref = float((target.double() * g).sum(-1).square().sum())
    return err, ref


def metric_errors(g_fit: torch.Tensor, converted: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """The error CONVERTED - TARGET relative to TARGET, weighed by F = mean g g^T of G_FIT, whole and its diagonal."""
    g = g_fit.double().flatten(0, 1)
    f = g.T @ g / g.shape[0]
    e, a = (converted - target).double().flatten(0, 1), target.double().flatten(0, 1)
    whole = float(((e @ f) * e).sum() / ((a @ f) * a).sum())
    d = f.diagonal()
    return whole, float((e.square() @ d).sum() / (a.square() @ d).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, calib_samples=128)
    ap.add_argument("--seed", type=int, default=0, help="of the labels drawn for the gradients")
    args = ap.parse_args()
    start = time.time()
    st = setup(args)
    candidates, held = st.candidates, args.held
    calib = calibration_ids(st.source, st.opts, st.source.config.vocab_size)[: 2 * held]
    gpl = text_ids(st.source, "GPL-3", held, args.calib_seq_len)
    ids = torch.cat([calib, gpl])
    fit, test, check = slice(0, held), slice(held, 2 * held), slice(2 * held, ids.shape[0])
    grads = attention_gradients(st.source, ids, args.seed)
    print(f"per-layer budget {st.per_layer}; candidates {candidates}; fit {held}, held out {held}, GPL-3 "
          f"{ids.shape[0] - 2 * held} sequences; statistics and gradients {time.time() - start:.0f} s", flush=True)

    measures = ("error", "fisher", "fisher GPL-3", "mean F", "diag F")
    sums = {m: dict.fromkeys(candidates, 0.0) for m in (*measures, "kl")}
    choices = {m: [] for m in measures}
    for i, tensors, hidden, target in source_layers(st.source, st.shape, ids):
        cells = {m: {} for m in measures}
        for c in candidates:
            _, block, run, _, _, _ = refit_at(st, i, tensors, c, hidden[fit], target[fit])
            out = attention(block, run, hidden[held:])
            conv, conv_check = out[: held], out[held:]
            a, a_check = target[test], target[check]
            cells["error"][c] = float((conv - a).double().square().sum() / a.double().square().sum())
            err, ref = fisher_error(grads[i][test], conv, a)
            cells["fisher"][c] = err / ref
            sums["kl"][c] += err / held
            err, ref = fisher_error(grads[i][check], conv_check, a_check)
            cells["fisher GPL-3"][c] = err / ref
            cells["mean F"][c], cells["diag F"][c] = metric_errors(grads[i][fit], conv, a)
        for m in measures:
            for c in candidates:
                sums[m][c] += cells[m][c]
            choices[m].append(min(candidates, key=lambda c, m=m: (cells[m][c], c)))
        print(f"layer {i}: " + "; ".join(f"{m} " + " ".join(f"{v:.4f}" for v in cells[m].values())
                                         + f" -> {choices[m][-1]}" for m in measures), flush=True)
    print("sums, d_R " + " / ".join(map(str, candidates)))
    for m, t in sums.items():
        print(f"{m:13s} " + " / ".join(f"{v:.4f}" for v in t.values()) + f"   least: d_R {min(t, key=t.get)}")
    for m in measures:
        print(f"per-layer choice by {m}: {choices[m]}")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
