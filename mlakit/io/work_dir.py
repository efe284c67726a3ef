"""The work directory of a streaming conversion: what a resumed run needs, on disk.

``.OUT.partial-streaming`` beside OUT holds the output shards as they grow, ``state.json``
(settings fingerprint, finished layers, the shard writer's cursor), the calibration hidden
states after the last finished layer (two raw files used in turn, so the input of the running
layer is never overwritten; ``STORE_DTYPE``), the verification streams, and, for planned allocation,
each layer's spilled statistics (and, when a refinement follows, the source stream as one file
per layer instead of the two in turn, and each layer's attention outputs, removed as the convert
pass finishes the layer). Every file a commit points
to is complete before ``state.json`` is replaced (write to a temporary name, fsync, rename). The
finished checkpoint is renamed to OUT; the resume-only files are removed first.

A work directory nothing resumes from (the in-memory pipeline's scratch directory, removed when
its run fails) is not ``durable``: its files are written without fsync. Only a machine crash would
need them on disk, and such a run starts over anyway; a sync waits for the disk's write-back of
every kept hidden state, which a write to the page cache does not.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

__all__ = ["STORE_DTYPE", "HiddenStore", "WorkDir", "open_work_dir", "work_dir_for"]

log = logging.getLogger(__name__)

_RESUME_PREFIXES = ("state.json", "hidden-", "verify.pt", "stats-", "sens-")
# The calibration hidden states on disk. Every layer reads them back whole, and a two-pass plan that refines
# keeps every layer's inputs and targets until the convert pass, so their bytes are most of a conversion's disk
# traffic (docs/results.md, "Conversion cost"). bfloat16 halves them and keeps float32's range (a residual
# stream can hold values float16 cannot); its rounding is far below any compression error, and a refit counts
# a start within it as exact (``refine.exact_loss``).
STORE_DTYPE = torch.bfloat16
_PENDING_WRITES = 2  # chunks a writer may hold while its thread writes them (bounds its memory)


def work_dir_for(out: Path) -> Path:
    out = Path(out).resolve()
    return out.parent / f".{out.name}.partial-streaming"


def _replace_atomically(path: Path, write, durable: bool = True) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)


class WorkDir:
    """PATH, the work directory; DURABLE: whether its files are synced to disk before a commit points to
    them (module docstring)."""

    def __init__(self, path: Path, durable: bool = True):
        self.path = Path(path)
        self.durable = durable

    def state(self) -> dict | None:
        path = self.path / "state.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def commit(self, state: dict) -> None:
        text = json.dumps(state, indent=1, allow_nan=False)
        _replace_atomically(self.path / "state.json", lambda f: f.write(text.encode()), self.durable)

    def save_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        _replace_atomically(self.path / name, lambda f: torch.save(tensors, f), self.durable)

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.path / name, map_location="cpu", weights_only=True)

    def remove_resume_files(self) -> None:
        for p in self.path.iterdir():
            if p.name.startswith(_RESUME_PREFIXES):
                p.unlink()


class HiddenStore:
    """Calibration hidden states (N, L, D) in raw files of DTYPE (default: ``STORE_DTYPE`` when the store
    is made; slots: two per stream, used in turn, or one per layer where the source stream's inputs are
    kept, and the kept targets), read back as float32 by row ranges with plain file IO (no memory map,
    so they never count toward RSS). DURABLE: a closed file is synced to disk (``WorkDir.durable``)."""

    def __init__(self, directory: Path, n_seq: int, seq_len: int, hidden: int, durable: bool = True,
                 dtype: torch.dtype | None = None):
        self.directory = Path(directory)
        self.durable = durable
        self.dtype = STORE_DTYPE if dtype is None else dtype
        self.shape = (n_seq, seq_len, hidden)
        self._row_bytes = seq_len * hidden * self.dtype.itemsize

    def path(self, slot: int | str) -> Path:
        return self.directory / f"hidden-{slot}.bin"

    def nbytes(self, rows: int) -> int:
        return rows * self._row_bytes

    def remove(self, slot: int | str) -> None:
        self.path(slot).unlink(missing_ok=True)

    def round(self, hidden: torch.Tensor) -> torch.Tensor:
        """HIDDEN as a write and a read give it back (float32): what a value computed instead of read must
        be, so that a run gives the same result whether it keeps a value on disk or computes it again."""
        return hidden.to(self.dtype).float()

    def read(self, slot: int | str, start: int, stop: int) -> torch.Tensor:
        count = (stop - start) * self._row_bytes
        data = np.fromfile(self.path(slot), dtype=np.uint8, count=count, offset=start * self._row_bytes)
        if data.size != count:
            raise RuntimeError(f"{self.path(slot)} is truncated; the work directory is damaged, delete it")
        return torch.from_numpy(data).view(self.dtype).float().view(stop - start, *self.shape[1:])

    def writer(self, slot: int | str):
        """A file to append (B, L, D) chunks to, in row order; closing syncs it when the store is durable."""
        return _ChunkWriter(self.path(slot), self.durable, self.dtype)


class _ChunkWriter:
    """Each chunk is copied in the store's dtype at once (the caller may reuse its tensor) and written by
    one background thread, so the layer's compute goes on while the disk takes it: a write to the page
    cache blocks once the kernel throttles dirty pages, which a conversion's hidden states reach. A failed
    write is raised by the next ``write`` or on closing."""

    def __init__(self, path: Path, durable: bool, dtype: torch.dtype):
        self._file = open(path, "wb")  # noqa: SIM115 - closed in __exit__
        self._durable = durable
        self._dtype = dtype
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hidden-store")
        self._pending = collections.deque()

    def write(self, chunk: torch.Tensor) -> None:
        data = chunk.detach().to("cpu", self._dtype, copy=True).contiguous().view(torch.uint8)
        while len(self._pending) >= _PENDING_WRITES:
            self._pending.popleft().result()
        self._pending.append(self._thread.submit(self._file.write, memoryview(data.numpy())))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        try:
            while self._pending:
                failed = self._pending.popleft().exception()
                if failed is not None and exc_type is None:  # the caller's own error, if any, comes first
                    raise failed
            self._file.flush()
            if self._durable:
                os.fsync(self._file.fileno())
        finally:
            self._pending.clear()
            self._thread.shutdown()
            self._file.close()


def _mismatch(old: dict, new: dict) -> str:
    """What differs between the fingerprint OLD of an interrupted run and NEW, in words."""
    from .fingerprint import describe_fingerprint

    if old.get("version") != new.get("version"):
        return (
            f"it was written by another mlakit version (work directory format {old.get('version')}, this one "
            f"reads {new.get('version')})"
        )
    changed = sorted(
        k
        for k in set(old.get("settings", {})) | set(new["settings"])
        if old.get("settings", {}).get(k) != new["settings"].get(k)
    )
    if changed:
        return f"settings {', '.join(changed)} differ from the interrupted run's"
    was, now = old.get("source_content") or {}, new.get("source_content") or {}
    if was.get("digest") != now.get("digest"):
        return (
            f"the source checkpoint's content changed: the interrupted run read {describe_fingerprint(was)}, "
            f"the source is now {describe_fingerprint(now)}"
        )
    return "the source path, the shard size or the work directory's format version differ from the interrupted run's"


def open_work_dir(work: WorkDir, fingerprint: dict, resume: bool) -> dict:
    """The state to continue from (resume only from the same source content and settings), or a
    fresh one in a new work directory."""
    from ..pipeline.settings import ConversionError

    state = work.state() if work.path.is_dir() else None
    if work.path.exists() and state is None:
        shutil.rmtree(work.path)  # interrupted before its first commit: nothing to keep
    if state is not None:
        if not resume:
            raise ConversionError(
                f"{work.path} holds an interrupted conversion ({len(state.get('layers', []))} "
                f"layers done); pass --resume to continue it, or delete that directory to start over"
            )
        if state.get("fingerprint") != fingerprint:
            raise ConversionError(
                f"cannot resume {work.path}: {_mismatch(state.get('fingerprint', {}), fingerprint)}. Rerun "
                f"with the same source and settings, or delete that directory to start over"
            )
        log.info("resuming %s: %d layers done", work.path, len(state["layers"]))
        return state
    if resume:
        log.info("--resume: no interrupted conversion at %s; starting from the first layer", work.path)
    work.path.mkdir(parents=True)
    return {"fingerprint": fingerprint, "layers": []}
