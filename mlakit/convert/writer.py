"""Write the files of a converted checkpoint (into a staging directory that ``output_dir``
publishes as OUT when complete)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

# the publisher moved to output_dir; these names stay importable from here for existing callers
from .output_dir import OutputExistsError, atomic_output

__all__ = [
    "AUTO_MAP", "MODEL_FILES", "OutputExistsError", "atomic_output", "save_state_dict", "write_json",
    "write_modeling_code",
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
        try:
            save_file(shard, str(directory / fname), metadata={"format": "pt"})
        except Exception as exc:  # safetensors reports a full disk as its own SafetensorError
            need = sum(t.numel() * t.element_size() for t in state.values())
            free = shutil.disk_usage(directory).free
            raise OSError(
                f"could not write {directory / fname}: {exc}. The checkpoint needs about {need / 1e6:.1f} MB; "
                f"{free / 1e6:.1f} MB are free there. Free some space (or raise the file size limit) and rerun"
            ) from exc
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
    """DATA as strict JSON (a NaN or infinity is an error, never a bare ``NaN`` literal)."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")
