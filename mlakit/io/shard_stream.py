"""Safetensors shards written tensor by tensor, in a layout fixed before the first byte.

The streaming conversion knows every output tensor's name, shape and dtype before it
converts anything (ranks are chosen first), so each shard's header can be written up front
and tensors appended as they are produced: no shard is ever held in memory. The write
position is one cursor (shard, byte offset, tensor index); a resumed conversion truncates the
open shard back to the last committed cursor and continues. The files are plain safetensors
(``writer.save_state_dict`` writes a whole state dict through the same writer).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Cursor", "ShardLayout", "ShardStreamWriter", "dtype_of_code", "read_header"]

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def dtype_of_code(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype CODE ("F32", "BF16", ...), as a header or ``get_slice`` names it."""
    return next(dtype for dtype, c in _DTYPE_CODES.items() if c == code)


@dataclass
class Cursor:
    shard: int = 0
    offset: int = 0  # bytes already in the current shard file (header included); 0 = not created
    tensor: int = 0  # tensors written so far, in layout order


class ShardLayout:
    """Ordered tensors (name, shape, dtype) split into shards of at most MAX_SHARD_BYTES."""

    def __init__(
        self, entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int = 2 * 1024**3
    ):
        self.entries = entries
        self.shards: list[list[int]] = [[]]
        size = 0
        for i, (_, shape, dtype) in enumerate(entries):
            nbytes = _nbytes(shape, dtype)
            if self.shards[-1] and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(i)
            size += nbytes
        n = len(self.shards)
        self.files = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.shard_of = {entries[i][0]: s for s, idx in enumerate(self.shards) for i in idx}
        self.index = {name: i for i, (name, _, _) in enumerate(entries)}

    def header(self, shard: int) -> bytes:
        """The shard's safetensors header: length prefix and JSON padded to 8 bytes."""
        meta: dict = {"__metadata__": {"format": "pt"}}
        start = 0
        for i in self.shards[shard]:
            name, shape, dtype = self.entries[i]
            end = start + _nbytes(shape, dtype)
            meta[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [start, end]}
            start = end
        text = json.dumps(meta, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    def shard_bytes(self, shard: int) -> int:
        return len(self.header(shard)) + sum(_nbytes(*self.entries[i][1:]) for i in self.shards[shard])

    def weight_map(self) -> dict[str, str]:
        return {name: self.files[self.shard_of[name]] for name, _, _ in self.entries}

    def total_bytes(self) -> int:
        return sum(_nbytes(shape, dtype) for _, shape, dtype in self.entries)


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


class ShardStreamWriter:
    """Append tensors in LAYOUT order to the shard files in DIRECTORY, from CURSOR on. DURABLE: ``sync``
    forces the written bytes to disk (a resumable work directory's commit needs them there); the
    finished shards are synced either way."""

    def __init__(self, layout: ShardLayout, directory: Path, cursor: Cursor | None = None, durable: bool = True):
        self.layout, self.directory = layout, Path(directory)
        self.durable = durable
        self.cursor = cursor or Cursor()
        self._file = None
        self._reopen()

    def _path(self, shard: int) -> Path:
        return self.directory / self.layout.files[shard]

    def _reopen(self) -> None:
        """Bring the files to the cursor: earlier shards complete, the current one truncated, later ones gone."""
        c = self.cursor
        for s in range(c.shard):
            path = self._path(s)
            if not path.is_file() or path.stat().st_size != self.layout.shard_bytes(s):
                raise RuntimeError(
                    f"{path} is missing or incomplete; the work directory is damaged, delete it"
                )
        for s in range(c.shard + 1, len(self.layout.files)):
            self._path(s).unlink(missing_ok=True)
        if c.offset:
            path = self._path(c.shard)
            if not path.is_file() or path.stat().st_size < c.offset:
                raise RuntimeError(
                    f"{path} is shorter than its committed size; the work directory is damaged, delete it"
                )
            self._file = open(path, "r+b")  # noqa: SIM115 - kept open across layers, closed in close()
            self._file.truncate(c.offset)
            self._file.seek(c.offset)
        else:
            self._path(c.shard).unlink(missing_ok=True)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        c, layout = self.cursor, self.layout
        if c.tensor >= len(layout.entries) or layout.entries[c.tensor][0] != name:
            want = (
                layout.entries[c.tensor][0] if c.tensor < len(layout.entries) else "nothing (layout complete)"
            )
            raise RuntimeError(f"shard writer expected {want}, got {name}")
        _, shape, dtype = layout.entries[c.tensor]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, layout says {tuple(shape)} {dtype}"
            )
        if layout.shard_of[name] != c.shard:
            self._finish_shard()
        try:
            if self._file is None:
                self._file = open(self._path(c.shard), "wb")  # noqa: SIM115 - closed in _finish_shard / close
                header = layout.header(c.shard)
                self._file.write(header)
                c.offset = len(header)
            data = tensor.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()
            self._file.write(memoryview(data))
        except OSError as exc:  # a full disk or a file size limit
            free = shutil.disk_usage(self.directory).free
            raise OSError(
                f"could not write {self._path(c.shard)}: {exc}. The checkpoint needs about "
                f"{layout.total_bytes() / 1e6:.1f} MB; {free / 1e6:.1f} MB are free there. Free some space (or raise "
                f"the file size limit) and rerun"
            ) from exc
        c.offset += data.nbytes
        c.tensor += 1

    def _finish_shard(self) -> None:
        if self._file is not None:
            self._sync_file()
            self._file.close()
            self._file = None
        self.cursor.shard += 1
        self.cursor.offset = 0

    def sync(self) -> None:
        """Flush written bytes to disk when durable (call before committing the cursor)."""
        if self._file is not None and self.durable:
            self._sync_file()

    def _sync_file(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._sync_file()
            self._file.close()
            self._file = None

    def finish(self) -> list[str]:
        """Check every tensor was written, close, and write the index when there are several shards."""
        if self.cursor.tensor != len(self.layout.entries):
            missing = self.layout.entries[self.cursor.tensor][0]
            raise RuntimeError(f"shard writer finished early: {missing} and later tensors were never written")
        self.close()
        if len(self.layout.files) > 1:
            index = {
                "metadata": {"total_size": self.layout.total_bytes()},
                "weight_map": self.layout.weight_map(),
            }
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, allow_nan=False) + "\n")
        return list(self.layout.files)


def read_header(path: Path) -> dict:
    """Name -> {dtype, shape, data_offsets} of a safetensors file, read without mapping its data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return meta
