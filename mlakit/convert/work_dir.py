"""The work directory of a streaming conversion: what a resumed run needs, on disk.

``.OUT.partial-streaming`` beside OUT holds the output shards as they grow, ``state.json``
(settings fingerprint, finished layers, the shard writer's cursor), the calibration hidden
states after the last finished layer (two raw float32 files used in turn, so the input of the
running layer is never overwritten), the verification streams, and, for planned allocation,
each layer's spilled statistics. Every file a commit points to is complete before
``state.json`` is replaced (write to a temporary name, fsync, rename). The finished checkpoint
is renamed to OUT; the resume-only files are removed first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

__all__ = ["HiddenStore", "WorkDir", "work_dir_for"]

_RESUME_PREFIXES = ("state.json", "hidden-", "verify.pt", "stats-", "sens-")


def work_dir_for(out: Path) -> Path:
    out = Path(out).resolve()
    return out.parent / f".{out.name}.partial-streaming"


def _replace_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class WorkDir:
    def __init__(self, path: Path):
        self.path = Path(path)

    def state(self) -> dict | None:
        path = self.path / "state.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def commit(self, state: dict) -> None:
        _replace_atomically(self.path / "state.json", lambda f: f.write(json.dumps(state, indent=1).encode()))

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        _replace_atomically(self.path / name, lambda f: torch.save(tensors, f))

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.path / name, map_location="cpu", weights_only=True)

    def remove_resume_files(self) -> None:
        for p in self.path.iterdir():
            if p.name.startswith(_RESUME_PREFIXES):
                p.unlink()


class HiddenStore:
    """Calibration hidden states (N, L, D) float32 in two raw files, read and written by row
    ranges with plain file IO (no memory map, so they never count toward RSS)."""

    def __init__(self, directory: Path, n_seq: int, seq_len: int, hidden: int):
        self.directory = Path(directory)
        self.shape = (n_seq, seq_len, hidden)
        self._row_bytes = seq_len * hidden * 4

    def path(self, slot: int) -> Path:
        return self.directory / f"hidden-{slot}.bin"

    def read(self, slot: int, start: int, stop: int) -> torch.Tensor:
        count = (stop - start) * self.shape[1] * self.shape[2]
        data = np.fromfile(self.path(slot), dtype=np.float32, count=count, offset=start * self._row_bytes)
        if data.size != count:
            raise RuntimeError(f"{self.path(slot)} is truncated; the work directory is damaged, delete it")
        return torch.from_numpy(data).view(stop - start, *self.shape[1:])

    def writer(self, slot: int):
        """A file to append (B, L, D) chunks to, in row order; closing syncs it."""
        return _ChunkWriter(self.path(slot))


class _ChunkWriter:
    def __init__(self, path: Path):
        self._file = open(path, "wb")  # noqa: SIM115 - closed in __exit__

    def write(self, chunk: torch.Tensor) -> None:
        self._file.write(memoryview(chunk.detach().float().contiguous().cpu().numpy()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
