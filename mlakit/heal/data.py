"""Training data for healing: text packed into fixed-length token sequences, in a seeded order
that can be resumed at any sequence.

The SPEC forms are those of :mod:`mlakit.data` (always the ``calib`` role, so ``builtin`` never
yields evaluation text), plus ``random`` (uniform random token ids, for tokenizer-less test
models). Two layouts:

* in memory (``builtin``, a text file, ``random``): the text is tokenized once and cut into
  ``seq_len`` windows; the last ``n_val`` windows are held out for the before/after loss and
  never trained on; epoch ``e`` visits the other windows in a permutation drawn from
  ``seed`` and ``e``. Sequence ``k`` of the stream is found without replaying ``0..k-1``.
* streamed (``hf:NAME[:CONFIG[:SPLIT]]``): rows come through ``datasets`` streaming, are
  tokenized and packed in order (separated by EOS); the first ``n_val`` packed sequences
  are held out, the rest pass a seeded shuffle buffer. Resuming replays the stream up to
  the saved position (tokenization only, no model work).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from mlakit.data import BUILTIN_SPEC, DataSpecError, load_text, parse_hf, tokenize_text

__all__ = ["PackedSequences", "RANDOM_SPEC", "open_training_data"]

logger = logging.getLogger(__name__)

RANDOM_SPEC = "random"
RANDOM_TOKENS = 1 << 16  # length of the random token stream
SHUFFLE_BUFFER = 1024  # packed sequences in the streaming shuffle buffer


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))


class PackedSequences:
    """A seeded, endless stream of (seq_len,) LongTensors plus a held-out validation batch.

    ``iterate(start)`` yields the training sequences from stream position ``start`` on; the
    same seed gives the same stream, so a run resumed at position k sees what an
    uninterrupted run sees from k.
    """

    def __init__(
        self,
        spec: str,
        seq_len: int,
        seed: int,
        n_val: int,
        ids: torch.Tensor | None = None,
        stream_factory=None,
        eos_id: int | None = None,
    ):
        self.spec, self.seq_len, self.seed, self.n_val = spec, seq_len, seed, n_val
        self._stream_factory = stream_factory
        self._eos_id = eos_id
        if ids is not None:
            n_seq = int(ids.numel()) // seq_len
            if n_seq < n_val + 1:
                raise DataSpecError(
                    f"data spec {spec!r} gives {int(ids.numel())} tokens: {n_seq} sequences of --seq-len {seq_len}, "
                    f"but healing needs at least {n_val + 1} ({n_val} held out for the before/after loss, one to "
                    "train on). Fix: use a longer text (e.g. --data builtin) or a smaller --seq-len."
                )
            windows = ids[: n_seq * seq_len].view(n_seq, seq_len)
            self.train = windows[: n_seq - n_val]  # (n_train, seq_len)
            self.validation = windows[n_seq - n_val :]  # (n_val, seq_len)
            logger.info(
                "heal data %s: %d training sequences of %d tokens, %d held out",
                spec,
                len(self.train),
                seq_len,
                n_val,
            )
        else:
            self.train = None
            first = self._first_sequences(n_val)
            self.validation = torch.stack(first) if first else torch.empty(0, seq_len, dtype=torch.long)

    @property
    def n_train(self) -> int | None:
        """Training sequences per epoch (None for a stream of unknown length)."""
        return None if self.train is None else len(self.train)

    def iterate(self, start: int = 0) -> Iterator[torch.Tensor]:
        if self.train is not None:
            yield from self._iterate_memory(start)
        else:
            yield from self._iterate_stream(start)

    # -- in memory -------------------------------------------------------------------------
    def _iterate_memory(self, start: int) -> Iterator[torch.Tensor]:
        n = len(self.train)
        epoch, index = divmod(start, n)
        while True:
            order = torch.randperm(n, generator=_epoch_generator(self.seed, epoch))
            for i in order[index:].tolist():
                yield self.train[i]
            epoch, index = epoch + 1, 0

    # -- streamed --------------------------------------------------------------------------
    def _packed(self, rows) -> Iterator[torch.Tensor]:
        buffer: list[int] = []
        for ids in rows:
            buffer.extend(ids)
            if self._eos_id is not None:
                buffer.append(self._eos_id)
            while len(buffer) >= self.seq_len:
                yield torch.tensor(buffer[: self.seq_len], dtype=torch.long)
                del buffer[: self.seq_len]

    def _first_sequences(self, n: int) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for seq in self._packed(self._stream_factory(0)):
            if len(out) == n:
                return out  # and at least one sequence is left to train on
            out.append(seq)
        raise DataSpecError(
            f"data spec {self.spec!r}: the dataset gave fewer than {n + 1} sequences of {self.seq_len} tokens. "
            "Fix: use a larger dataset or split, or a smaller --seq-len."
        )

    def _iterate_stream(self, start: int) -> Iterator[torch.Tensor]:
        position, epoch = 0, 0
        while True:
            rng = random.Random(self.seed * 1_000_003 + epoch)
            packed = self._packed(self._stream_factory(epoch))
            for _ in range(self.n_val):  # held out
                next(packed, None)
            buffer: list[torch.Tensor] = []
            epoch_start = position
            for out in self._shuffled(packed, buffer, rng):
                position += 1
                if position > start:
                    yield out
            if position == epoch_start:
                raise DataSpecError(
                    f"data spec {self.spec!r}: no training sequences after the {self.n_val} held out. "
                    "Fix: use a larger dataset or a smaller --seq-len."
                )
            epoch += 1

    @staticmethod
    def _shuffled(packed, buffer: list, rng: random.Random) -> Iterator[torch.Tensor]:
        """Seeded shuffle through a buffer of SHUFFLE_BUFFER sequences."""
        for seq in packed:
            if len(buffer) < SHUFFLE_BUFFER:
                buffer.append(seq)
                continue
            j = rng.randrange(len(buffer))
            out, buffer[j] = buffer[j], seq
            yield out
        rng.shuffle(buffer)
        yield from buffer


def _hf_row_stream(spec: str, tokenizer):
    """A factory: epoch -> iterator of token-id lists, one per non-empty 'text' row."""
    name, config, split = parse_hf(spec, "calib")
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is a dependency
        raise DataSpecError(f"data spec {spec!r} needs the 'datasets' package: pip install datasets") from exc
    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as exc:  # datasets raises many types (network, missing config, bad split)
        raise DataSpecError(
            f"data spec {spec!r}: could not stream dataset {name!r} (config {config!r}, split {split!r}): "
            f"{type(exc).__name__}: {exc}. Fix: check the name, config and split, or use --data builtin or a "
            "local text file (offline)."
        ) from exc
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "text" not in columns:
        raise DataSpecError(
            f"data spec {spec!r}: dataset {name!r} has no 'text' column (columns: {columns}). "
            "Fix: choose a dataset with a 'text' column, or export the text to a local file."
        )

    def rows(epoch: int):
        del epoch  # the order within a row stream is the dataset's; shuffling happens after packing
        for row in dataset:
            text = row.get("text")
            if text:
                yield tokenizer(text, add_special_tokens=False)["input_ids"]

    return rows


def open_training_data(
    spec: str, tokenizer, vocab_size: int, seq_len: int, seed: int, n_val: int
) -> PackedSequences:
    """The heal data named by SPEC (see the module doc); TOKENIZER may be None only for ``random``."""
    if not isinstance(spec, str) or not spec.strip():
        raise DataSpecError(
            "--data is empty. Fix: pass --data builtin, a text file, hf:NAME[:CONFIG[:SPLIT]] or random."
        )
    spec = spec.strip()
    if spec == RANDOM_SPEC:
        gen = torch.Generator().manual_seed(int(seed) + 7919)
        ids = torch.randint(0, vocab_size, (max(RANDOM_TOKENS, (n_val + 64) * seq_len),), generator=gen)
        return PackedSequences(spec, seq_len, seed, n_val, ids=ids)
    if spec.startswith("hf:"):
        parse_hf(spec, "calib")  # a malformed spec is reported before a missing tokenizer
    elif spec != BUILTIN_SPEC and not Path(spec).expanduser().is_file():
        load_text(spec, "calib")  # raises the data module's error for this spec
    if tokenizer is None:
        raise DataSpecError(
            f"data spec {spec!r} is text, but neither the converted model nor the teacher has tokenizer files. "
            "Fix: copy the tokenizer into the converted directory, or pass --data random for a smoke test."
        )
    if spec.startswith("hf:"):
        eos = getattr(tokenizer, "eos_token_id", None)
        return PackedSequences(
            spec, seq_len, seed, n_val, stream_factory=_hf_row_stream(spec, tokenizer), eos_id=eos
        )
    ids = tokenize_text(tokenizer, load_text(spec, "calib"))
    return PackedSequences(spec, seq_len, seed, n_val, ids=ids)
