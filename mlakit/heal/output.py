"""Disk IO of healing: the healed checkpoint (atomically, in the converted directory's own
format) and the checkpoint folders of a run."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from mlakit.io.writer import save_state_dict, write_json

__all__ = [
    "HealError",
    "checkpoint_dirs",
    "latest_checkpoint",
    "check_work_dir",
    "read_weight_layout",
    "remove_work_dir",
    "save_checkpoint",
    "write_run_settings",
    "write_healed",
]

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
}
CHECKPOINT_PREFIX = "step-"
SETTINGS_FILE = "heal_settings.json"


class HealError(ValueError):
    """A heal setting or input that cannot work; the message names it, the allowed values and the fix."""


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
    claim,
    state: dict[str, torch.Tensor],
    layout: dict[str, torch.dtype],
    heal_report: dict,
) -> None:
    """Write DEST (claimed by CLAIM, ``output_dir.claim_output``) atomically: every file of SOURCE_DIR except its weights, the weights of STATE
    (exactly the names and dtypes of LAYOUT), and conversion.json with a ``heal`` entry."""
    missing = sorted(set(layout) - set(state))
    if missing:
        raise RuntimeError(
            f"healed state lacks {len(missing)} tensors of the converted checkpoint, e.g. {missing[:3]}"
        )
    weights = {name: state[name].detach().to("cpu", layout[name]).contiguous() for name in layout}
    with claim.staging() as tmp:
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
    logger.info("wrote healed model %s", claim.out)


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


def _differences(saved: dict, run: dict) -> str:
    from mlakit.io.fingerprint import describe_fingerprint

    parts = []
    for key in run:
        if saved.get(key) == run[key]:
            continue
        if key.endswith("_content"):
            if (saved.get(key) or {}).get("digest") != run[key]["digest"]:
                role = key.removesuffix("_content")
                parts.append(
                    f"{role}: the checkpointed run's was {describe_fingerprint(saved.get(key))}, now "
                    f"{describe_fingerprint(run[key])}"
                )
        else:
            parts.append(f"{key}: checkpoint {saved.get(key)!r} vs now {run[key]!r}")
    return "; ".join(parts)


def check_work_dir(work_dir: Path, resume: bool, run: dict) -> Path | None:
    """Check WORK_DIR against --resume and the run's settings and model fingerprints RUN; returns
    the checkpoint to resume from (or None). Reads only: every process runs it, so a refusal
    stops all of them before any collective call."""
    settings_file = work_dir / SETTINGS_FILE
    ckpt = latest_checkpoint(work_dir)
    if ckpt is not None and not resume:
        raise HealError(
            f"{work_dir} already holds checkpoint {ckpt.name} of an earlier run. Fix: pass --resume to "
            f"continue it, or remove {work_dir} to start over."
        )
    if ckpt is not None:
        saved = json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.is_file() else {}
        diff = _differences(saved, run)
        if diff:
            hint = ""
            if saved.get("sequences_per_step") != run.get("sequences_per_step"):
                hint = (
                    " Sequences per optimizer step are --batch-size x --grad-accum x processes; to resume "
                    "with another process count, scale --batch-size or --grad-accum so that the product "
                    f"stays {saved.get('sequences_per_step')}."
                )
            raise HealError(
                f"--resume with a different run than the checkpointed one in {work_dir} ({diff}).{hint} Fix: "
                f"rerun with the original models and settings, or remove {work_dir} to start a new run."
            )
    if resume and ckpt is None:
        logger.warning("--resume: no checkpoint in %s yet, starting from step 0", work_dir)
    return ckpt


def write_run_settings(work_dir: Path, run: dict) -> None:
    """Record RUN (what a resume must match) in WORK_DIR; the main process only."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = work_dir / f".{SETTINGS_FILE}.tmp"
    tmp.write_text(json.dumps(run, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, work_dir / SETTINGS_FILE)


def remove_work_dir(work_dir: Path) -> None:
    """Remove what heal put in WORK_DIR (checkpoints, partial checkpoints, the settings file), and
    WORK_DIR itself when nothing else is left: a user's --work-dir may hold other files."""
    if not work_dir.is_dir():
        return
    for item in work_dir.iterdir():
        if item.is_dir() and item.name.startswith((CHECKPOINT_PREFIX, f".partial-{CHECKPOINT_PREFIX}")):
            shutil.rmtree(item, ignore_errors=True)
    (work_dir / SETTINGS_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        work_dir.rmdir()
