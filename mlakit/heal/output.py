"""Disk IO of healing: the healed checkpoint (atomically, in the converted directory's own
format) and the checkpoint folders of a run."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from mlakit.convert.writer import atomic_output, save_state_dict, write_json

__all__ = ["checkpoint_dirs", "latest_checkpoint", "read_weight_layout", "save_checkpoint", "write_healed"]

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
CHECKPOINT_PREFIX = "step-"


def _weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("model*.safetensors"))


def read_weight_layout(directory: Path) -> dict[str, torch.dtype]:
    """Tensor name -> dtype of the weights saved in a converted DIRECTORY."""
    from safetensors import safe_open

    files = _weight_files(directory)
    if not files:
        raise ValueError(
            f"{directory} holds no model*.safetensors; pass the output directory of `mla-convert convert`"
        )
    layout = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                layout[name] = _SAFETENSORS_DTYPES.get(f.get_slice(name).get_dtype(), torch.float32)
    return layout


def write_healed(
    source_dir: Path,
    dest: Path,
    state: dict[str, torch.Tensor],
    layout: dict[str, torch.dtype],
    heal_report: dict,
    overwrite: bool,
) -> None:
    """Write DEST atomically: every file of SOURCE_DIR except its weights, the weights of STATE
    (exactly the names and dtypes of LAYOUT), and conversion.json with a ``heal`` entry."""
    missing = sorted(set(layout) - set(state))
    if missing:
        raise RuntimeError(
            f"healed state lacks {len(missing)} tensors of the converted checkpoint, e.g. {missing[:3]}"
        )
    weights = {name: state[name].detach().to("cpu", layout[name]).contiguous() for name in layout}
    with atomic_output(dest, overwrite) as tmp:
        skip = {p.name for p in _weight_files(source_dir)} | {
            "model.safetensors.index.json",
            "conversion.json",
        }
        for item in source_dir.iterdir():
            if item.name in skip:
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        save_state_dict(weights, tmp)
        report = {}
        conv = source_dir / "conversion.json"
        if conv.is_file():
            report = json.loads(conv.read_text(encoding="utf-8"))
        report["heal"] = heal_report
        write_json(tmp / "conversion.json", report)
    logger.info("wrote healed model %s", dest)


def checkpoint_dirs(work_dir: Path) -> list[Path]:
    """Complete checkpoints of WORK_DIR, oldest first."""
    if not work_dir.is_dir():
        return []
    found = [p for p in work_dir.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def latest_checkpoint(work_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(work_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(accelerator, work_dir: Path, step: int, keep: int) -> Path:
    """accelerator.save_state into a temporary folder renamed to step-N when complete, so a crash
    while saving never leaves a half-written checkpoint; older checkpoints beyond KEEP are removed."""
    final = work_dir / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = work_dir / f".partial-{CHECKPOINT_PREFIX}{step:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoint_dirs(work_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
