"""The work directory's hidden-state store: chunks read back in order, as ``round`` says; a failed write is
not swallowed."""

from __future__ import annotations

import pytest
import torch

from mlakit.io import work_dir
from mlakit.io.work_dir import HiddenStore


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_read_back_in_order_and_the_caller_may_reuse_its_tensor(tmp_path, dtype):
    store = HiddenStore(tmp_path, n_seq=6, seq_len=3, hidden=4, dtype=dtype)
    data = store.round(torch.randn(6, 3, 4) * 1e3)
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


def test_the_default_store_halves_the_bytes_and_reads_back_what_round_gives(tmp_path):
    store = HiddenStore(tmp_path, n_seq=2, seq_len=5, hidden=8)
    assert store.dtype == work_dir.STORE_DTYPE == torch.bfloat16
    data = torch.randn(2, 5, 8) * torch.logspace(-3, 4, 8)  # bfloat16 keeps float32's range
    with store.writer("c") as sink:
        sink.write(data)
    assert store.path("c").stat().st_size == store.nbytes(2) == data.numel() * 2
    back = store.read("c", 0, 2)
    assert back.dtype == torch.float32 and torch.equal(back, store.round(data))
    assert not torch.equal(back, data)  # it did round
    assert torch.allclose(back, data, rtol=2**-8, atol=0)


def test_the_stores_rounding_is_within_what_a_refit_counts_as_exact(tmp_path):
    """A full-rank start differs from its rounded targets by the rounding alone; ``exact_loss`` must
    cover that (or a bit-exact conversion would be refitted), and stay far below compression errors."""
    from mlakit.convert.refine import EXACT_LOSS, exact_loss

    assert exact_loss(torch.float32) == EXACT_LOSS
    store = HiddenStore(tmp_path, n_seq=1, seq_len=1, hidden=1)
    for scale in (1e-4, 1.0, 3e4):
        y = torch.randn(64, 512) * scale * torch.rand(64, 1)  # rows of very different sizes
        relative = float((store.round(y) - y).double().square().sum() / y.double().square().sum())
        assert EXACT_LOSS < relative <= exact_loss(store.dtype) / 2
    assert exact_loss(torch.bfloat16) == 2.0**-16
