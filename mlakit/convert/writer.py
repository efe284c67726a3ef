"""Write converted checkpoints atomically: everything goes to a temporary directory beside
OUT, which is renamed to OUT only when complete."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = [
    "OutputExistsError", "atomic_output", "check_output", "publish", "save_state_dict", "write_modeling_code", "write_json",
    "MODEL_FILES",
]

log = logging.getLogger(__name__)

_PKG = Path(__file__).resolve().parent.parent
# Files that make a checkpoint load with trust_remote_code and no mlakit installed.
MODEL_FILES = {
    "configuration_mla.py": _PKG / "mla_model" / "configuration_mla.py",
    "modeling_mla.py": _PKG / "mla_model" / "modeling_mla.py",
    "decode_dispatch.py": _PKG / "kernels" / "decode_dispatch.py",
    "decode_reference.py": _PKG / "kernels" / "decode_reference.py",
    "decode_triton.py": _PKG / "kernels" / "decode_triton.py",
}
AUTO_MAP = {
    "AutoConfig": "configuration_mla.MLAConfig",
    "AutoModel": "modeling_mla.MLAModel",
    "AutoModelForCausalLM": "modeling_mla.MLAForCausalLM",
}


class OutputExistsError(FileExistsError):
    pass


@contextlib.contextmanager
def atomic_output(out: Path, overwrite: bool):
    """Yield a fresh temporary directory; on success it replaces OUT, on any error it is removed."""
    out = check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_output(out: Path, overwrite: bool) -> Path:
    """OUT resolved; an error if it exists (without OVERWRITE) or is not a directory."""
    out = Path(out).resolve()
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it or choose another path")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory; remove it or choose another path")
    return out


def publish(tmp: Path, out: Path) -> None:
    """Rename the finished directory TMP to OUT, replacing an existing OUT only once TMP is complete."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def save_state_dict(state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = 2 * 1024**3) -> list[str]:
    """Sharded safetensors with an index when there is more than one shard."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        write_json(directory / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def write_modeling_code(directory: Path) -> None:
    """Copy the self-contained model code; package-relative kernel imports become flat ones."""
    for name, src in MODEL_FILES.items():
        if not src.exists():
            continue
        text = src.read_text().replace("from ..kernels.", "from .")
        (directory / name).write_text(text)


def write_json(path: Path, data) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
