"""The work directory's hidden-state store: chunks read back in order; a failed write is not swallowed."""

from __future__ import annotations

import pytest
import torch

from mlakit.io import work_dir
from mlakit.io.work_dir import HiddenStore


def test_chunks_read_back_in_order_and_the_caller_may_reuse_its_tensor(tmp_path):
    store = HiddenStore(tmp_path, n_seq=6, seq_len=3, hidden=4)
    data = torch.randn(6, 3, 4)
    buffer = torch.empty(2, 3, 4)
    with store.writer("a") as sink:
        for s in range(0, 6, 2):
            buffer.copy_(data[s : s + 2])
            sink.write(buffer)  # the same tensor each time
            buffer.fill_(float("nan"))
    assert torch.equal(store.read("a", 0, 6), data)
    assert torch.equal(store.read("a", 2, 5), data[2:5])


def test_a_failed_write_reaches_the_caller(tmp_path, monkeypatch):
    store = HiddenStore(tmp_path, n_seq=4, seq_len=2, hidden=2)

    class Failing:
        def __init__(self, real):
            self.real = real

        def write(self, data):
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.real, name)

    real_open = open
    monkeypatch.setattr(work_dir, "open", lambda *a, **k: Failing(real_open(*a, **k)), raising=False)
    with pytest.raises(OSError, match="No space left"), store.writer("b") as sink:
        sink.write(torch.zeros(2, 2, 2))
