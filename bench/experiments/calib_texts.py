"""Calibration texts of other kinds than the builtin one, for measuring how much the kind of calibration
text decides the quality on a text (bench/quality_ablation.py --calib-data; results in
bench/results/quality_ablation_values/calibration_kinds.md).

    python bench/experiments/calib_texts.py legal /tmp/legal.txt          # licences other than the GPL family
    python bench/experiments/calib_texts.py docstrings /tmp/docs.txt      # builtin calibration + stdlib docstrings
    python bench/experiments/calib_texts.py code /tmp/code.txt            # stdlib source files as they are
    python bench/experiments/calib_texts.py generated /tmp/gen.txt        # sampled from the default model

- ``legal``: the Debian licences that share no text with the GPL-3 evaluation text (Apache-2.0,
  MPL-2.0, Artistic, CC0-1.0, BSD; the GPL, LGPL and GFDL files are left out), about 9K tokens.
- ``docstrings``: the builtin calibration text followed by as many characters of docstrings (longer
  than 200 characters) of the standard library's modules, classes and functions, every k-th one so
  that they spread over the whole library (tests and GUI packages left out).
- ``code``: the standard library's source files as they are (code, comments, docstrings), every k-th
  file so that they add up to about the builtin calibration text's length (the same packages left out),
  for mixing with it (``--calib builtin,code.txt``).
- ``generated``: 128 sequences of 256 tokens sampled from the source model from its BOS token
  (temperature 1, top-p 0.95, seed 0): the model's own distribution, whatever text it was trained on.
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
from pathlib import Path

LICENCES = Path("/usr/share/common-licenses")
LEGAL = ("Apache-2.0", "MPL-2.0", "Artistic", "CC0-1.0", "BSD")
SKIPPED_PACKAGES = ("idlelib", "lib2to3", "tkinter", "site-packages")  # and any with "test" in its name


def legal() -> str:
    return "".join((LICENCES / name).read_text() for name in LEGAL)


def _stdlib_sources() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(lib.rglob("*.py")):
        parts = path.relative_to(lib).parts
        if parts[0] in SKIPPED_PACKAGES or "test" in parts[0] or "tests" in parts:
            continue
        try:
            out.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return out


def _spread(items: list[str], length: int) -> str:
    """Every k-th of ITEMS, k chosen so that they add up to about LENGTH characters."""
    step = max(1, round(sum(map(len, items)) / length))
    return "\n\n".join(items[::step])


def _builtin() -> str:
    from mlakit.data import load_text

    return load_text("builtin", "calib")


def code() -> str:
    return _spread(_stdlib_sources(), len(_builtin()))


def docstrings() -> str:
    builtin = _builtin()
    found = []
    for source in _stdlib_sources():
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    found.append(doc)
    return builtin + "\n\n" + _spread(found, len(builtin))


def generated(sequences: int = 128, length: int = 256, batch: int = 32) -> str:
    import torch

    from mlakit.io.source import open_source

    source = open_source("default")
    model, tokenizer = source.load_model(), source.tokenizer()
    torch.manual_seed(0)
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    texts = []
    for _ in range(0, sequences, batch):
        ids = torch.full((batch, 1), start)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=0.95,
                             max_new_tokens=length, min_new_tokens=length, pad_token_id=tokenizer.eos_token_id)
        texts += tokenizer.batch_decode(out[:, 1:], skip_special_tokens=True)
    return "\n\n".join(texts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("legal", "docstrings", "code", "generated"))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    text = {"legal": legal, "docstrings": docstrings, "code": code, "generated": generated}[args.kind]()
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: {len(text)} characters")


if __name__ == "__main__":
    main()
