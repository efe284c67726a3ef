"""Content fingerprints of checkpoints: what a resumed run checks so that it never continues work
made from other weights.

File names and sizes are not enough: a checkpoint replaced by another of the same shapes has the
same names and sizes. A fingerprint hashes every weight file (its safetensors header included) and
the config; reading the files once costs a fraction of a conversion or a heal run, which read them
all anyway.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

__all__ = ["WEIGHT_PATTERNS", "content_fingerprint", "describe_fingerprint", "file_sha256"]

log = logging.getLogger(__name__)

# the weights a loader reads: safetensors when a directory has them (as from_pretrained prefers), else pickles
WEIGHT_PATTERNS = (("*.safetensors",), ("pytorch_model*.bin", "*.pt"))
_CHUNK = 16 * 1024 * 1024


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_fingerprint(path) -> dict:
    """{"path", "files": [[name, size, sha256], ...], "digest"} of a checkpoint PATH: a weight file
    (e.g. a .gguf) or a directory (the weight files its loader reads, ``WEIGHT_PATTERNS``, and
    config.json)."""
    path = Path(path).expanduser().resolve()
    if path.is_file():
        files = [path]
    else:
        files = []
        for patterns in WEIGHT_PATTERNS:
            files = sorted({p for pattern in patterns for p in path.glob(pattern) if p.is_file()})
            if files:
                break
        files += [path / "config.json"] if (path / "config.json").is_file() else []
    tick = time.time()
    entries = [[p.name, p.stat().st_size, file_sha256(p)] for p in files]
    log.debug("fingerprinted %s (%d files) in %.1f s", path, len(files), time.time() - tick)
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    return {"path": str(path), "files": entries, "digest": digest}


def describe_fingerprint(fp: dict | None) -> str:
    """A short human form: the path and the first 12 hex digits of the content digest."""
    if not fp:
        return "an unrecorded model"
    return f"{fp.get('path', '?')} (content {str(fp.get('digest', '?'))[:12]})"
