"""Each shared rope dim d_R's attention error after the value refit on text of other kinds: does the error on the
calibration's kind rank the candidates as other text does?

    cd bench && python experiments/rope_dim_shift.py --source default --kv-budget 0.3125 --candidates 24,32,40,48
    cd bench && python experiments/rope_dim_shift.py --source /tmp/qwen2-small --kv-budget 0.3125

``--rope-dim measured`` picks the d_R whose value refit has the least held-out error on the calibration's own
kind of text (``mlakit/convert/rope_choice.py``). On SmolLM2 at 68.75% that picks more rotary dims than the
unseen texts prefer (docs/results.md, "The rotary share measured in the conversion"). Here every layer is
converted at each candidate as experiments/rope_dim_measured.py converts it (the fold measured, the latent at
the uniform rank, the value refit on the first --held calibration sequences), and its relative attention error
is measured, on the source stream, on --held sequences of each of these texts:

- ``calib``: the refit's own cross-validated (held-out) error on the calibration sequences, as the rule sees it;
- ``sampled``: text the source model samples itself from its BOS token (temperature 1, seeded), which no user
  text decides: the model's own distribution;
- ``shuffled``, ``reversed`` and ``random``: text a streaming conversion can build without running the whole
  model: the calibration sequences with their tokens permuted (seeded; ``--rope-dim measured`` checks its choice
  on these, ``rope_choice.shuffled_sequences``) or in reverse order, and tokens drawn uniformly (seeded) from
  those the calibration sequences hold, each sequence keeping its first token;
- ``GPL-3`` and ``vim manual``: the quality benches' unseen texts. They are read here to test a proxy, never by
  a rule: a rule tuned on them would fit the test.

``--kinds`` picks which of these to measure (``calib`` always).

Printed: per layer and text, each candidate's error; then the sums.
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
from fold_measured import held_ids, source_layers  # noqa: E402
from quality_ablation import TEXTS  # noqa: E402
from rope_dim_measured import add_arguments, refit_at, relative_error, setup  # noqa: E402

from mlakit.convert.rope_choice import shuffled_sequences  # noqa: E402
from mlakit.data import tokenize_text  # noqa: E402

KINDS = ("sampled", "shuffled", "reversed", "random", "GPL-3", "vim manual")


@torch.no_grad()
def sampled_ids(source, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """N sequences of SEQ_LEN tokens the source samples from its BOS token at temperature 1."""
    model = source.load_model(torch.float32)
    tok = source.tokenizer()
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    torch.manual_seed(seed)
    prompt = torch.full((n, 1), start)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0, top_k=0,
                         top_p=1.0, max_new_tokens=seq_len - 1, min_new_tokens=seq_len - 1, pad_token_id=start)
    return out[:, :seq_len]


def proxy_ids(calib: torch.Tensor, kind: str, seed: int = 0) -> torch.Tensor:
    """CALIB (n, T) made unlike itself without a model (``shuffled``, ``reversed``, ``random``); the first token
    kept."""
    if kind == "shuffled":  # what --rope-dim measured checks its choice on
        return shuffled_sequences(calib, seed)
    out = calib.clone()
    if kind == "reversed":
        out[:, 1:] = calib[:, 1:].flip(1)
    else:
        seen = calib.unique()
        generator = torch.Generator().manual_seed(seed)
        out[:, 1:] = seen[torch.randint(seen.numel(), calib[:, 1:].shape, generator=generator)]
    return out


def text_ids(source, name: str, n: int, seq_len: int) -> torch.Tensor:
    ids = tokenize_text(source.tokenizer(), TEXTS[name]())
    k = min(n, ids.numel() // seq_len)
    return ids[: k * seq_len].view(k, seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap, calib_samples=128)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of " + ", ".join(KINDS))
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"--kinds: unknown {sorted(unknown)}; choose from {KINDS}")
    start = time.time()
    st = setup(args)
    candidates, seq_len = st.candidates, args.calib_seq_len
    calib = held_ids(st.source, st.opts, args.held)
    made = {"sampled": lambda: sampled_ids(st.source, args.held, seq_len, seed=0),
            **{k: (lambda k=k: proxy_ids(calib, k)) for k in ("shuffled", "reversed", "random")},
            **{k: (lambda k=k: text_ids(st.source, k, args.held, seq_len)) for k in ("GPL-3", "vim manual")}}
    texts = {"calib": calib} | {k: made[k]() for k in KINDS if k in kinds}
    spans, at = {}, 0
    for name, ids in texts.items():
        spans[name] = slice(at, at + ids.shape[0])
        at += ids.shape[0]
    print(f"per-layer budget {st.per_layer}; candidates {candidates}; sequences "
          f"{ {k: v.shape[0] for k, v in texts.items()} }; statistics and sampling {time.time() - start:.0f} s")

    totals = {name: dict.fromkeys(candidates, 0.0) for name in texts}
    all_ids = torch.cat(list(texts.values()))
    for i, tensors, hidden, target in source_layers(st.source, st.shape, all_ids):
        fit = spans["calib"]
        cells = {name: [] for name in texts}
        for c in candidates:
            _, block, run, _, _, held = refit_at(st, i, tensors, c, hidden[fit], target[fit])
            for name, span in spans.items():
                err = held if name == "calib" else relative_error(block, run, hidden[span], target[span])
                totals[name][c] += err
                cells[name].append(f"{err:.4f}")
        print(f"layer {i}: " + "; ".join(f"{name} " + " ".join(v) for name, v in cells.items()), flush=True)
    print("sums, d_R " + " / ".join(map(str, candidates)))
    for name, t in totals.items():
        best = min(t, key=t.get)
        print(f"{name:12s} " + " / ".join(f"{v:.4f}" for v in t.values()) + f"   least: d_R {best}")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
