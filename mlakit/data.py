"""Text sources for evaluation and calibration, named by one SPEC string.

A SPEC is one of

* ``builtin``: offline English text that ships with Python (``pydoc_data.topics``, the
  language reference behind ``help()``). Its topics are split deterministically into a
  calibration part and a disjoint evaluation part, so a model is never judged on the text
  it was calibrated on.
* a path to a local text file (UTF-8).
* ``hf:NAME[:CONFIG[:SPLIT]]``: a Hugging Face dataset read through ``datasets``; the
  rows of its ``text`` column are joined with blank lines (the usual wikitext recipe).
  The split defaults to ``test`` for evaluation and ``train`` for calibration.

Every error a user can cause here is a :class:`DataSpecError` naming the spec, the allowed
forms and the fix.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import torch

__all__ = [
    "BUILTIN_SPEC",
    "DataSpecError",
    "ROLES",
    "builtin_topic_split",
    "calibration_batches",
    "calibration_relation",
    "load_text",
    "parse_hf",
    "split_mix",
    "tokenize_text",
]

logger = logging.getLogger(__name__)

BUILTIN_SPEC = "builtin"
ROLES = ("eval", "calib")
HF_PREFIX = "hf:"
# One topic in EVAL_MODULUS goes to evaluation (chosen by a CRC of its key, so the split
# of a topic does not move when other topics are added in a later Python version).
EVAL_MODULUS = 5
DEFAULT_SPLIT = {"eval": "test", "calib": "train"}

ALLOWED_FORMS = (
    "allowed forms: 'builtin' (offline text shipped with Python), a path to a local UTF-8 "
    "text file, or 'hf:NAME[:CONFIG[:SPLIT]]' (e.g. 'hf:wikitext:wikitext-2-raw-v1:test')"
)


class DataSpecError(ValueError):
    """A text SPEC that cannot be resolved; the message names the spec and the fix."""


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def builtin_topic_split() -> dict[str, list[str]]:
    """Sorted topic keys of ``pydoc_data.topics`` for each role; the two lists are disjoint."""
    from pydoc_data.topics import topics

    split: dict[str, list[str]] = {"eval": [], "calib": []}
    for key in sorted(topics):
        role = "eval" if zlib.crc32(key.encode("utf-8")) % EVAL_MODULUS == 0 else "calib"
        split[role].append(key)
    return split


def _load_builtin(role: str) -> str:
    from pydoc_data.topics import topics

    keys = builtin_topic_split()[role]
    return "\n\n".join(topics[key].strip() for key in keys)


def _load_file(spec: str) -> str:
    path = Path(spec).expanduser()
    if path.is_dir():
        raise DataSpecError(
            f"data spec {spec!r} is a directory, not a text file; {ALLOWED_FORMS}. "
            "Fix: pass the path of one .txt file."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataSpecError(
            f"data spec {spec!r}: the file is not valid UTF-8 ({exc}). Fix: convert it to UTF-8 text."
        ) from exc
    except OSError as exc:
        raise DataSpecError(
            f"data spec {spec!r}: cannot read the file ({exc}). Fix: check the path."
        ) from exc
    return text


def parse_hf(spec: str, role: str) -> tuple[str, str | None, str]:
    """(dataset name, config or None, split) of an ``hf:NAME[:CONFIG[:SPLIT]]`` SPEC; the split
    defaults by ROLE (eval or calib)."""
    parts = spec[len(HF_PREFIX) :].split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts[1:]):
        raise DataSpecError(
            f"data spec {spec!r} is malformed; {ALLOWED_FORMS}. "
            "Fix: write hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT with no empty fields."
        )
    name = parts[0]
    config = parts[1] if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else DEFAULT_SPLIT[role]
    return name, config, split


def _load_hf(spec: str, role: str, flag: str = "--data") -> str:
    name, config, split = parse_hf(spec, role)
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise DataSpecError(
            f"data spec {spec!r} needs the 'datasets' package, which is not installed. "
            f"Fix: pip install datasets, or use {flag} builtin or a local text file."
        ) from exc
    logger.info("loading dataset %s (config %s, split %s)", name, config, split)
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # datasets raises many types (network, missing config, bad split)
        raise DataSpecError(
            f"data spec {spec!r}: could not load dataset {name!r} (config {config!r}, split {split!r}): "
            f"{type(exc).__name__}: {exc}. Without network access the hub cannot be reached. "
            f"Fix: use {flag} builtin (offline text) or the path of a local text file, or check the "
            "dataset name, config and split."
        ) from exc
    columns = list(getattr(dataset, "column_names", None) or [])
    if "text" not in columns:
        raise DataSpecError(
            f"data spec {spec!r}: dataset {name!r} has no 'text' column (columns: {columns}). "
            "Fix: choose a dataset with a 'text' column, or export the text to a local file."
        )
    return "\n\n".join(row for row in dataset["text"] if row)


def load_text(spec: str, role: str, flag: str = "--data") -> str:
    """Return the text named by ``spec`` for ``role`` ("eval" or "calib").

    ``builtin`` gives disjoint text for the two roles; a file or a dataset split gives the
    same text for both (choose different files or splits to keep them apart).
    """
    _check_role(role)
    if not isinstance(spec, str) or not spec.strip():
        raise DataSpecError(f"data spec {spec!r} is empty; {ALLOWED_FORMS}. Fix: pass {flag} builtin.")
    spec = spec.strip()
    if spec == BUILTIN_SPEC:
        text = _load_builtin(role)
    elif spec.startswith(HF_PREFIX):
        text = _load_hf(spec, role, flag)
    elif Path(spec).expanduser().exists():
        text = _load_file(spec)
    else:
        mix = " A mix of texts (SPEC,SPEC) is read only by convert's --calib." if "," in spec else ""
        raise DataSpecError(
            f"data spec {spec!r} is not 'builtin', not an 'hf:' dataset and no file of that name "
            f"exists; {ALLOWED_FORMS}.{mix} Fix: correct the path, or use {flag} builtin."
        )
    if not text.strip():
        raise DataSpecError(
            f"data spec {spec!r} gave no text for role {role!r}. Fix: use a non-empty file or dataset, "
            f"or {flag} builtin."
        )
    logger.info("data %s (%s): %d characters", spec, role, len(text))
    return text


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` as a 1-D LongTensor, without special tokens.

    The whole text is encoded in one call (any length: the model-length warning of the
    tokenizer does not apply, windows are cut afterwards).
    """
    old_max = getattr(tokenizer, "model_max_length", None)
    try:
        if old_max is not None:
            tokenizer.model_max_length = int(1e30)  # silence "sequence longer than ..." warning
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    finally:
        if old_max is not None:
            tokenizer.model_max_length = old_max
    return torch.tensor(ids, dtype=torch.long)


def split_mix(spec: str) -> list[str]:
    """The text SPECs of a calibration mix ``SPEC[,SPEC...]``: one entry for a single spec, and for a
    path that exists as written even when its name holds a comma."""
    if "," not in spec or Path(spec).expanduser().exists():
        return [spec]
    parts = [part.strip() for part in spec.split(",")]
    if any(not part for part in parts):
        raise DataSpecError(
            f"calibration mix {spec!r} has an empty entry; {ALLOWED_FORMS}. "
            "Fix: separate the specs with single commas, e.g. 'builtin,notes.txt'."
        )
    return parts


def _same_text(eval_spec: str, calib_spec: str) -> bool:
    """Whether EVAL_SPEC read for evaluation gives the text CALIB_SPEC gives for calibration."""
    if eval_spec.startswith(HF_PREFIX) and calib_spec.startswith(HF_PREFIX):
        try:
            return parse_hf(eval_spec, "eval") == parse_hf(calib_spec, "calib")
        except DataSpecError:
            return False
    a, b = Path(eval_spec).expanduser(), Path(calib_spec).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def calibration_relation(eval_spec: str, calib_spec: str | None) -> str | None:
    """How the evaluation text EVAL_SPEC stands to a conversion's calibration CALIB_SPEC (a mix too):
    "calibration text" (it is, or is in, the calibration: the ratio measured on it is optimistic),
    "calibration source, disjoint part" (``builtin`` for both: the same kind of text, other topics),
    "other text", or None when the calibration is not known or was random token ids."""
    if not calib_spec or calib_spec == "random":
        return None
    specs = split_mix(calib_spec)
    if any(_same_text(eval_spec, one) for one in specs):
        return "calibration text"
    if eval_spec == BUILTIN_SPEC and BUILTIN_SPEC in specs:
        return "calibration source, disjoint part"
    return "other text"


def calibration_batches(
    tokenizer, spec: str, n_samples: int, seq_len: int, seed: int, flag: str = "--data"
) -> torch.Tensor:
    """``n_samples`` windows of ``seq_len`` token ids drawn at seeded random offsets.

    SPEC may be a mix, ``SPEC[,SPEC...]``: the windows are then shared out equally among its texts
    (the first ones take the remainder), whatever their lengths, so a short text of the kind a
    model will serve weighs as much as a long general one, and they follow each other in turns.
    Every text is read and checked before any is tokenized.

    Returns a LongTensor of shape (n_samples, seq_len). Windows are distinct offsets while a text
    has enough of them, and may overlap. The same arguments give the same tensor.
    """
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"n_samples and seq_len must be >= 1, got n_samples={n_samples}, seq_len={seq_len}")
    specs = split_mix(spec)
    if len(specs) > n_samples:
        raise DataSpecError(
            f"calibration mix {spec!r} names {len(specs)} texts for {n_samples} sequences. "
            "Fix: raise the number of calibration sequences or name fewer texts."
        )
    texts = [load_text(one, "calib", flag) for one in specs]
    shares = [n_samples // len(specs) + (i < n_samples % len(specs)) for i in range(len(specs))]
    # the first text keeps the run's seed, so a single spec draws the windows it always drew
    parts = [
        _text_windows(tokenizer, one, text, share, seq_len, seed + i, flag)
        for i, (one, text, share) in enumerate(zip(specs, texts, shares))
    ]
    # taken in turns, so the first sequences (the sensitivity pass's, --refine-sequences') are a mix too
    return torch.stack([part[j] for j in range(shares[0]) for part in parts if j < part.shape[0]])


def _text_windows(tokenizer, spec: str, text: str, n_samples: int, seq_len: int, seed: int, flag: str):
    ids = tokenize_text(tokenizer, text)
    n_tokens = int(ids.numel())
    if n_tokens < seq_len:
        raise DataSpecError(
            f"calibration data {spec!r} has {n_tokens} tokens, fewer than one window of seq_len={seq_len}. "
            f"Fix: lower the calibration sequence length, or use a longer text (e.g. {flag} builtin)."
        )
    n_starts = n_tokens - seq_len + 1
    generator = torch.Generator().manual_seed(int(seed))
    if n_samples <= n_starts:
        starts = torch.randperm(n_starts, generator=generator)[:n_samples]
    else:
        logger.warning(
            "calibration data %s has only %d distinct windows of %d tokens; %d samples repeat some",
            spec,
            n_starts,
            seq_len,
            n_samples,
        )
        starts = torch.randint(0, n_starts, (n_samples,), generator=generator)
    offsets = torch.arange(seq_len)
    return ids[starts.unsqueeze(1) + offsets.unsqueeze(0)]  # (n_samples, seq_len)
