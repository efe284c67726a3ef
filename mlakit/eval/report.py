"""Write an evaluation or benchmark report directory: ``report.json``, ``report.md``, PNG plots.

The directory appears whole or not at all: everything is written into a temporary sibling
directory which is then renamed into place. An existing directory is replaced only when it
is empty or is an earlier report (holds ``report.json``), never an unrelated folder.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path

__all__ = ["ReportDirError", "check_report_dir", "json_safe", "write_report_dir"]

logger = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


class ReportDirError(ValueError):
    """The report directory cannot be written; the message says why and the fix."""


def json_safe(obj):
    """A copy of ``obj`` that ``json.dumps`` accepts strictly: NaN/inf become None, paths
    and other objects their ``str``, tuples lists."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return json_safe(obj.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(obj)


def check_report_dir(report_dir: str | Path) -> None:
    """Raise :class:`ReportDirError` now if ``report_dir`` could not be written later."""
    _check_target(Path(report_dir).expanduser().resolve())


def _check_target(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise ReportDirError(f"report path {target} exists and is not a directory; pass a new directory name")
    if target.is_dir() and any(target.iterdir()) and not (target / REPORT_JSON).is_file():
        raise ReportDirError(
            f"report directory {target} exists and is not an mlakit report (no {REPORT_JSON}); "
            "refusing to replace it. Pass a new or empty directory."
        )


def write_report_dir(
    report_dir: str | Path, report: dict, markdown: str, figures: dict | None = None
) -> Path:
    """Write ``report`` (JSON), ``markdown`` and each ``figures[name]`` (a matplotlib Figure,
    saved as ``name``) into ``report_dir`` atomically; returns the final path."""
    target = Path(report_dir).expanduser().resolve()
    _check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, fig in (figures or {}).items():
            fig.savefig(tmp / name, dpi=120)
        text = json.dumps(json_safe(report), indent=2, sort_keys=False, allow_nan=False)
        (tmp / REPORT_JSON).write_text(text + "\n", encoding="utf-8")
        (tmp / REPORT_MD).write_text(markdown, encoding="utf-8")
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("report written to %s", target)
    return target
