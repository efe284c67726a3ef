"""Write the files of a converted checkpoint (into a staging directory that ``output_dir``
publishes as OUT when complete)."""

from __future__ import annotations

import json
import logging
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
    """STATE as sharded safetensors (names in sorted order), with an index when there is more than one
    shard: the layer-wise converter's shard writer, fed a whole state dict."""
    from .shard_stream import ShardLayout, ShardStreamWriter

    names = sorted(state)
    layout = ShardLayout([(n, tuple(state[n].shape), state[n].dtype) for n in names], max_shard_bytes)
    writer = ShardStreamWriter(layout, directory)
    try:
        for name in names:
            writer.write(name, state[name])
        return writer.finish()
    finally:
        writer.close()


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
