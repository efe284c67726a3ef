"""One process of a multi-process heal in the tests (launched by torchrun, see
tests/test_heal_distributed.py): runs ``mlakit.heal.heal`` with the options of a JSON file,
records the micro-batches this process trained on, and can stop the run after a given step.

    torchrun --standalone --nproc-per-node 2 tests/heal_worker.py SPEC.json

SPEC: {"out", "dest", "options" (HealOptions fields), "log" (a folder for batches-RANK.pt),
"stop_after" (a step, or null)}. A stop exits with status 3 after that step's checkpoint."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from mlakit.heal import HealOptions, heal

STOPPED = 3


def main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    rank = int(os.environ["RANK"])
    seen: list[tuple[int, torch.Tensor]] = []
    log = Path(spec["log"]) / f"batches-{rank}.pt"

    def on_batch(step, ids):
        seen.append((step, ids.clone()))

    def on_step(step):
        torch.save(seen, log)
        if step == spec.get("stop_after"):
            sys.exit(STOPPED)

    heal(spec["out"], spec["dest"], HealOptions(**spec["options"]), on_step=on_step, on_batch=on_batch)


if __name__ == "__main__":
    main(sys.argv[1])
