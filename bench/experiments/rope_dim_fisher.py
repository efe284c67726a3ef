"""Each layer's d_R judged by what its attention error costs the model's output, not by the error's size.

    cd bench && python experiments/rope_dim_fisher.py --source /tmp/qwen2-small --kv-budget 0.125 --detail 0 --others 16
    cd bench && python experiments/rope_dim_fisher.py --source default --kv-budget 0.3125 --candidates 16,24,32,40,48,56,64

``--rope-dim measured-per-layer`` gives each layer the d_R of least held-out attention error, sum ||a' - a||^2.
On the trained Qwen2-style model at 87.5% that gave layer 0 d_R 8 where the model's perplexity prefers 16
(docs/results.md, "d_R per layer, converted"). To second order, an error e_t added to the residual stream at
token t raises the expected KL of the model's next-token distribution by e_t^T F_t e_t / 2, F_t the Fisher of that
distribution with respect to the stream there. With labels y_t drawn from the model's own prediction,
F_t = E[g_t g_t^T], g_t the gradient of -log p(y_t) with respect to the attention's output at layer l: so
sum_t (g_t . e_t)^2 estimates twice the KL the layer's error alone adds through everything above it (linearised).
Every layer is converted at each candidate as ``--rope-dim measured`` converts it (the fold measured, the latent at
the uniform rank, the value refit on the first --held calibration sequences; ``rope_dim_measured.refit_at``) and
measured on the source stream, on the next --held calibration sequences (held out) unless named otherwise:

- ``error``: the relative attention error, what measured-per-layer reads;
- ``fisher``: sum_t (g_t . e_t)^2 / sum_t (g_t . a_t)^2, the Fisher-weighted error relative to the same weighting
  of the source attention's output a_t; ``fisher GPL-3`` and ``fisher shuffled`` the same on the GPL-3 licence
  and on the fitted sequences with their tokens shuffled (``rope_choice.shuffled_sequences``, as --rope-dim
  measured checks its choice): the licence is read to check a rule, never by one;
- ``mean F`` and ``diag F``: the error weighted by the token-averaged Fisher F = mean_t g_t g_t^T of the fitted
  sequences, whole and its diagonal (a metric a conversion could keep per layer, without pairing g and e token by
  token), relative to the same weighting of a.

Each measure's per-layer choices are then judged by the summed ``fisher GPL-3`` at them (``judged``).

``--detail L,...`` then prints, for those layers, how much the fisher measure moves between groups of 4 sequences
and between label draws (seeds 0-2), and the measure it stands in for: the KL of the model's prediction, on each
text, with that layer alone converted at each candidate (the others the source's), and with ``--others D`` also
with every other layer converted at d_R D.
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
from rope_dim_shift import proxy_ids, text_ids  # noqa: E402

from mlakit.convert.calibration import BATCH_SIZE  # noqa: E402
from mlakit.pipeline.api import calibration_ids  # noqa: E402
from mlakit.pipeline.layer_runner import SourceLayers  # noqa: E402

GROUP = 4  # sequences per group in --detail's spread
TEXTS = ("calib", "GPL-3", "shuffled")  # the held-out calibration sequences, the licence, the shuffled ones


def attention_gradients(model, ids: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Per layer, g (sequences, tokens, hidden): the gradient of sum_t -log p(y_t) with respect to the layer's
    attention output, y_t drawn from MODEL's own prediction at t (SEED)."""
    layers = model.model.layers
    generator = torch.Generator().manual_seed(seed)
    grads = [[] for _ in layers]
    for batch in ids.split(BATCH_SIZE):
        outs = []

        def keep(module, args, out, outs=outs):
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
    d = f.diagonal()
    return (float(((e @ f) * e).sum() / ((a @ f) * a).sum()),
            float((e.square() @ d).sum() / (a.square() @ d).sum()))


@torch.no_grad()
def log_probs(model, src: SourceLayers, modules: list, ids: torch.Tensor, converted: dict) -> torch.Tensor:
    """Log-probabilities of the model on IDS with layer j run as CONVERTED[j] = (block, run) where given."""
    out = []
    for s in range(0, ids.shape[0], BATCH_SIZE):
        h = model.model.embed_tokens(ids[s : s + BATCH_SIZE])
        for j, module in enumerate(modules):
            h = converted[j][1](converted[j][0], h) if j in converted else src.run(module, h)
        out.append(model.lm_head(model.model.norm(h)).log_softmax(-1))
    return torch.cat(out)


def judged(layers: list[dict], judge: str = "fisher GPL-3") -> dict[str, float]:
    """JUDGE summed over the layers at each measure's per-layer choice (LAYERS: per layer, measure -> d_R -> value),
    at the best shared d_R by JUDGE, and at JUDGE's own per-layer choice (what no rule can see)."""
    out = {m: sum(cells[judge][min(cells[m], key=lambda c, m=m, cells=cells: (cells[m][c], c))] for cells in layers)
           for m in layers[0]}
    shared = {c: sum(cells[judge][c] for cells in layers) for c in layers[0][judge]}
    best = min(shared, key=shared.get)
    return out | {f"shared d_R {best}": shared[best]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, calib_samples=128)
    ap.add_argument("--seed", type=int, default=0, help="of the labels drawn for the gradients")
    ap.add_argument("--detail", default="", help="comma-separated layers: the spread of the fisher measure and "
                                                 "the KL with the layer alone converted")
    ap.add_argument("--others", type=int, default=0, help="with --detail: also with every other layer at this d_R")
    args = ap.parse_args()
    start = time.time()
    st = setup(args)
    candidates, held = st.candidates, args.held
    detail = [int(x) for x in args.detail.split(",")] if args.detail else []
    calib = calibration_ids(st.source, st.opts, st.source.config.vocab_size)[: 2 * held]
    parts = [calib, text_ids(st.source, "GPL-3", held, args.calib_seq_len), proxy_ids(calib[:held], "shuffled")]
    ids = torch.cat(parts)
    spans, at = {}, 0
    for name, part in zip(("fit", *TEXTS), [calib[:held], calib[held:], *parts[1:]]):
        spans[name], at = slice(at, at + part.shape[0]), at + part.shape[0]
    model = st.source.load_model(torch.float32).requires_grad_(False)
    seeds = sorted({args.seed, *((0, 1, 2) if detail else ())})
    grads = {s: attention_gradients(model, ids, s) for s in seeds}
    g0 = grads[args.seed]
    print(f"per-layer budget {st.per_layer}; candidates {candidates}; sequences "
          f"{ {k: v.stop - v.start for k, v in spans.items()} }; statistics and gradients {time.time() - start:.0f} s",
          flush=True)

    measures = ("error", "fisher", "fisher GPL-3", "fisher shuffled", "mean F", "diag F")
    sums = {m: dict.fromkeys(candidates, 0.0) for m in measures}
    choices = {m: [] for m in measures}
    src, modules, kept, table = SourceLayers(st.source.config, st.shape.window), [], {}, []
    for i, tensors, hidden, target in source_layers(st.source, st.shape, ids):
        modules.append(src.layer(i, tensors))
        cells = {m: {} for m in measures}
        for c in candidates:
            _, block, run, _, _, _ = refit_at(st, i, tensors, c, hidden[spans["fit"]], target[spans["fit"]])
            if i in detail or c == args.others:
                kept[(i, c)] = (block, run)
            out = attention(block, run, hidden)
            conv = {k: out[span] for k, span in spans.items()}
            cells["error"][c] = float((conv["calib"] - target[spans["calib"]]).double().square().sum()
                                      / target[spans["calib"]].double().square().sum())
            for name, m in (("calib", "fisher"), ("GPL-3", "fisher GPL-3"), ("shuffled", "fisher shuffled")):
                err, ref = fisher_error(g0[i][spans[name]], conv[name], target[spans[name]])
                cells[m][c] = err / ref
            cells["mean F"][c], cells["diag F"][c] = metric_errors(g0[i][spans["fit"]], conv["calib"],
                                                                   target[spans["calib"]])
            if i in detail:
                for name in TEXTS:
                    span = spans[name]
                    for s in seeds:
                        cut = [slice(k, min(k + GROUP, span.stop)) for k in range(span.start, span.stop, GROUP)]
                        groups = [fisher_error(grads[s][i][g], out[g], target[g])[0] for g in cut]
                        print(f"  layer {i} d_R {c} {name} seed {s}: sum_t (g.e)^2 per {GROUP} sequences "
                              + " ".join(f"{v:.0f}" for v in groups), flush=True)
        table.append(cells)
        for m in measures:
            for c in candidates:
                sums[m][c] += cells[m][c]
            choices[m].append(min(candidates, key=lambda c, m=m: (cells[m][c], c)))
        print(f"layer {i}: " + "; ".join(f"{m} " + " ".join(f"{v:.4f}" for v in cells[m].values())
                                         + f" -> {choices[m][-1]}" for m in measures), flush=True)
    print("sums, d_R " + " / ".join(map(str, candidates)))
    for m, t in sums.items():
        print(f"{m:15s} " + " / ".join(f"{v:.4f}" for v in t.values()) + f"   least: d_R {min(t, key=t.get)}")
    for m in measures:
        print(f"per-layer choice by {m}: {choices[m]}")
    print("fisher GPL-3 summed at each measure's per-layer choice (the measure named GPL-3 itself: the best any "
          "per-layer rule could do): " + ", ".join(f"{m} {v:.4f}" for m, v in judged(table).items()))

    if detail:
        base = log_probs(model, src, modules, ids, {})

        def kl(converted: dict) -> str:
            lp = log_probs(model, src, modules, ids, converted)
            per_token = (base.exp() * (base - lp)).sum(-1)
            return "  ".join(f"{name} {float(per_token[spans[name]].mean()):.4f}" for name in TEXTS)

        for i in detail:
            for c in candidates:
                print(f"KL per token, layer {i} alone at d_R {c}: {kl({i: kept[(i, c)]})}", flush=True)
                if args.others:
                    others = {j: kept[(j, args.others)] for j in range(len(modules))} | {i: kept[(i, c)]}
                    print(f"KL per token, layer {i} at d_R {c}, the others at {args.others}: {kl(others)}", flush=True)
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
