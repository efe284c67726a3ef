"""RRR against BKV-PCA for the latent, on three kinds of text (SmolLM2-135M, perplexity ratio to
the source): the measurement behind ``--lowrank-method auto`` (``pipeline.AUTO_RRR_FROM``).

    python bench/experiments/lowrank_domains.py                      # 4 budgets, about 25 min on 2 cores

One calibration (builtin text, 128 x 256 tokens, with the loss sensitivities); at every budget two
conversions that differ only in the latent's factorisation, both with the scored RoPE split and the
damped fisher ranks. Each is scored, as in bench/quality_sweep.py (8192 tokens, window 512,
stride 448), on the builtin evaluation text (Python documentation, the calibration's kind of text),
the GPL-3 licence (legal prose) and the Vim user manual (usr_*.txt, a tutorial), where present.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quality_sweep import build_model  # noqa: E402

from mlakit.arch.families import attention_shape  # noqa: E402
from mlakit.convert.assemble import read_attention  # noqa: E402
from mlakit.convert.layer_metrics import layer_metrics  # noqa: E402
from mlakit.data import load_text, tokenize_text  # noqa: E402
from mlakit.eval.perplexity import sliding_windows, window_nll  # noqa: E402
from mlakit.io.source import open_source  # noqa: E402
from mlakit.pipeline.api import ConvertOptions  # noqa: E402
from mlakit.pipeline.whole_model import build_layers, calibrate  # noqa: E402

GPL3 = Path("/usr/share/common-licenses/GPL-3")
VIM_MANUAL = sorted(Path("/usr/share/vim/vim90/doc").glob("usr_[01]?.txt"))  # chapters 01-19


def eval_texts(workdir: Path) -> dict[str, str]:
    texts = {"builtin": "builtin"}
    if GPL3.is_file():
        texts["GPL-3"] = str(GPL3)
    if VIM_MANUAL:
        joined = workdir / "vim_user_manual.txt"
        joined.write_text("".join(p.read_text(errors="replace") for p in VIM_MANUAL))
        texts["Vim manual"] = str(joined)
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="0.5,0.3125,0.1875,0.125")
    args = ap.parse_args()
    torch.manual_seed(0)
    source = open_source("default")
    shape = attention_shape(source.config)
    with tempfile.TemporaryDirectory() as tmp:
        specs = eval_texts(Path(tmp))
        ids = {name: tokenize_text(source.tokenizer(), load_text(spec, "eval"))[:8192] for name, spec in specs.items()}
    windows = {name: sliding_windows(int(t.numel()), 512, 448) for name, t in ids.items()}

    def ratios(model, base=None):
        model.eval()
        out = {}
        for name, t in ids.items():
            w = windows[name]
            nll = torch.cat([window_nll(model, t, w[i : i + 4], "cpu") for i in range(0, len(w), 4)])
            out[name] = math.exp(float(nll.sum()) / sum(x.n_scored for x in w))
        return out if base is None else {k: v / base[k] for k, v in out.items()}

    base = ratios(source.load_model(torch.float32))
    opts = ConvertOptions(calib="builtin", kv_budget=1.0, allocation="fisher", quiet=True)
    ws = [read_attention(source, i, shape) for i in range(source.config.num_hidden_layers)]
    ms = [layer_metrics(w, st) for w, st in zip(ws, calibrate(source, shape, opts))]
    print("| budget | latent | " + " | ".join(ids) + " |\n|---|---|" + "---|" * len(ids), flush=True)
    for frac in (float(b) for b in args.budgets.split(",")):
        for low in ("rrr", "bkv_pca"):
            layers, _ = build_layers(ws, ms, shape, ConvertOptions(kv_budget=frac, lowrank_method=low))
            r = ratios(build_model(source, shape, layers), base)
            print(f"| {frac:g} | {low} | " + " | ".join(f"{v:.3f}" for v in r.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
