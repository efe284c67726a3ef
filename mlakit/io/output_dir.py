"""Where every command's output goes: checked before any work, locked while it is made, published
atomically, and never at the cost of anything mlakit did not create.

One publisher serves the in-memory pipeline, streaming, export, heal and inspect:

- ``check_output`` refuses, before any work, an OUT that exists (without ``--overwrite``), one that
  is not a directory, one ``--overwrite`` may not replace (only an earlier mlakit output, known by
  its marker file, or an empty directory), one that overlaps a source, and an unwritable location.
- ``claim_output`` holds an exclusive ``fcntl.flock`` on ``.OUT.lock`` beside OUT for the whole
  run (the file names the holder's pid and host; the kernel drops the lock when a holder dies, so
  a stale file is simply taken over), and removes unfinished outputs that earlier, killed runs into
  OUT left behind: only directories named ``.OUT.partial-*`` that hold our ``.mlakit-partial``
  marker, which no live run can own while we hold the lock.
- ``OutputClaim.staging`` yields a fresh ``.OUT.partial-XXXX`` (with the marker); ``publish``
  renames a finished directory to OUT with ``renameat2(RENAME_NOREPLACE)``, so a directory that
  appeared at OUT during the run is never replaced, or with ``RENAME_EXCHANGE`` under
  ``--overwrite`` (the old OUT is removed only once the new one is in place). Published outputs get
  the umask's normal permissions (``mkdtemp`` makes owner-only directories, safetensors owner-only
files), so a serving account can read them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

__all__ = [
    "OUTPUT_MARKERS",
    "PARTIAL_MARKER",
    "OutputBusyError",
    "OutputClaim",
    "OutputExistsError",
    "atomic_output",
    "check_output",
    "claim_output",
    "local_paths",
    "lock_path",
    "published_mode",
]

log = logging.getLogger(__name__)

# Files that make a directory an mlakit output that --overwrite may replace: a conversion (and a
# healed model) has conversion.json, a deepseek-v3 export has export.json.
OUTPUT_MARKERS = ("conversion.json", "export.json")
PARTIAL_MARKER = ".mlakit-partial"  # inside every staging directory we create, until it is published

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


class OutputExistsError(FileExistsError):
    """OUT exists (or appeared) and may not be replaced; the message says what to do."""


class OutputBusyError(OSError):
    """Another live run holds OUT's lock."""


def published_mode() -> tuple[int, int]:
    """(directory, file) permissions of a published output: 0777 and 0666 & ~umask, what ``mkdir``
    and ``open`` give (``mkdtemp`` and safetensors' writer make owner-only ones)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o777 & ~umask, 0o666 & ~umask


def _normal_permissions(directory: Path) -> None:
    dir_mode, file_mode = published_mode()
    os.chmod(directory, dir_mode)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)


def lock_path(out: Path) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.lock"


def _overlap(out: Path, source: Path) -> str | None:
    if out == source:
        return "is"
    if source in out.parents:
        return "is inside"
    if out in source.parents:
        return "contains"
    return None


def local_paths(*specs) -> list[Path]:
    """The SPECS that name existing local paths (a hub id is checked once it is resolved)."""
    return [Path(s).expanduser() for s in specs if Path(s).expanduser().exists()]


def _replaceable(out: Path, markers) -> bool:
    return any((out / m).is_file() for m in markers) or not any(out.iterdir())


def check_output(out, overwrite: bool, sources=(), markers=OUTPUT_MARKERS) -> Path:
    """OUT resolved, or an error naming the problem and the fix (see the module docstring)."""
    out = Path(out).expanduser().resolve()
    for source in sources:
        source = Path(source).expanduser().resolve()
        how = _overlap(out, source)
        if how is not None:
            raise OutputExistsError(
                f"output {out} {how} the source {source}; writing it would damage the source. "
                f"Choose an output directory outside {source}"
            )
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory; remove it or choose another path")
    if out.exists() and not overwrite:
        raise OutputExistsError(
            f"{out} already exists; pass --overwrite to replace it or choose another path"
        )
    if out.exists() and not _replaceable(out, markers):
        raise OutputExistsError(
            f"{out} is not empty and is not an mlakit output (it has no {' or '.join(markers)}), so "
            f"--overwrite will not replace it. Remove it by hand (rm -r {out}) if you mean to, or choose "
            f"another path"
        )
    existing = out.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create {out}: {existing} is not writable; choose a writable location")
    return out


def _rename(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(SRC, DST, FLAGS); False where the system or file system lacks it."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _appeared(out: Path) -> OutputExistsError:
    return OutputExistsError(
        f"{out} appeared while this run worked (something else created it); it was left untouched and "
        f"nothing was published. Choose another path, or remove it and rerun"
    )


def _write_marker(directory: Path) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    (directory / PARTIAL_MARKER).write_text(json.dumps(info) + "\n")


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


class OutputClaim:
    """OUT, checked and locked by ``claim_output``: stage into it and publish it."""

    def __init__(self, out: Path, overwrite: bool, markers=OUTPUT_MARKERS):
        self.out, self.overwrite, self.markers = out, overwrite, tuple(markers)
        self._fd: int | None = None

    def acquire(self) -> None:
        path = lock_path(self.out)
        while True:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                raise OSError(
                    f"cannot create {self.out} ({exc.strerror}: {exc.filename}); choose a writable location",
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputBusyError(
                    f"another mla-convert run is writing {self.out} (lock {path}: {holder}); wait for it to "
                    f"finish or stop it, or choose another path"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file its last holder unlinked while we waited on it
                break
            os.close(fd)
        stale = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if stale:
            log.info("taking over %s from a run that is gone (%s)", path, stale)
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        self._remove_leftovers()

    def release(self) -> None:
        if self._fd is not None:
            lock_path(self.out).unlink(missing_ok=True)  # while still held: no one can own this file
            os.close(self._fd)
            self._fd = None

    def _remove_leftovers(self) -> None:
        for path in sorted(self.out.parent.glob(f".{self.out.name}.partial-*")):
            marker = path / PARTIAL_MARKER
            if not marker.is_file():
                continue  # not ours (the streaming work directory has its own resume logic)
            try:
                info = json.loads(marker.read_text())
            except (OSError, ValueError):
                info = {}
            log.warning(
                "removing %s (%.1f MB): the unfinished output of an earlier run into %s that was killed "
                "(pid %s on %s, started %s)",
                path,
                _size(path) / 1e6,
                self.out,
                info.get("pid", "?"),
                info.get("host", "?"),
                info.get("started", "?"),
            )
            shutil.rmtree(path, ignore_errors=True)

    def scratch(self) -> Path:
        """A fresh ``.OUT.partial-XXXX`` with our marker (removed by a later run if this one is killed)."""
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        _write_marker(tmp)
        return tmp

    @contextlib.contextmanager
    def staging(self):
        """Yield a fresh staging directory; publish it when the block succeeds, remove it otherwise."""
        tmp = self.scratch()
        try:
            yield tmp
            self.publish(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def publish(self, tmp: Path) -> None:
        """Rename the finished directory TMP to OUT (see the module docstring)."""
        out = self.out
        (tmp / PARTIAL_MARKER).unlink(missing_ok=True)
        _normal_permissions(tmp)
        if out.exists() or out.is_symlink():
            if not self.overwrite:
                raise _appeared(out)
            if not out.is_dir() or not _replaceable(out, self.markers):
                raise OutputExistsError(
                    f"{out} changed while this run worked and is no longer an mlakit output or empty, so it "
                    f"was not replaced. Remove it by hand (rm -r {out}) if you mean to, and rerun"
                )
            if _rename(tmp, out, _RENAME_EXCHANGE):
                if not _replaceable(tmp, self.markers):  # filled between the check and the swap: swap back
                    _rename(tmp, out, _RENAME_EXCHANGE)
                    raise OutputExistsError(
                        f"{out} changed while it was being replaced; it was left as it was"
                    )
                _write_marker(tmp)  # TMP now holds the old OUT: a killed run leaves it to the next one
                shutil.rmtree(tmp, ignore_errors=True)
                return
            old = out.with_name(f".{out.name}.partial-replaced-{os.getpid()}")
            os.rename(out, old)
            _write_marker(old)
            self._rename_new(tmp)
            shutil.rmtree(old, ignore_errors=True)
            return
        self._rename_new(tmp)

    def _rename_new(self, tmp: Path) -> None:
        try:
            if _rename(tmp, self.out, _RENAME_NOREPLACE):
                return
            if self.out.exists():  # without renameat2: check, then rename (refuses a non-empty OUT)
                raise _appeared(self.out)
            os.rename(tmp, self.out)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise _appeared(self.out) from exc
            raise


@contextlib.contextmanager
def claim_output(out, overwrite: bool = False, sources=(), markers=OUTPUT_MARKERS):
    """Check OUT (``check_output``), lock it for the block and clear killed runs' leftovers."""
    claim = OutputClaim(check_output(out, overwrite, sources, markers), overwrite, markers)
    claim.acquire()
    try:
        yield claim
    finally:
        claim.release()


@contextlib.contextmanager
def atomic_output(out, overwrite: bool, sources=(), markers=OUTPUT_MARKERS):
    """Claim OUT and yield a staging directory that becomes OUT when the block succeeds."""
    with claim_output(out, overwrite, sources, markers) as claim, claim.staging() as tmp:
        yield tmp
