"""Sliding-window perplexity: the definition against hand-computed cases, window edge
cases, batching and identical token ids for every model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mlakit.eval.perplexity import Window, sliding_window_perplexity, sliding_windows, window_nll
from tests.eval_helpers import FixedLogitsLM, RecordingLM, tiny_llama


def _contexts(n, seq_len, stride):
    """target position -> number of context tokens, from the windows."""
    out = {}
    for w in sliding_windows(n, seq_len, stride):
        for t in range(w.score_from, w.end):
            assert t not in out, f"token {t} scored twice"
            out[t] = t - w.begin
    return out


@pytest.mark.parametrize(
    "n, seq_len, stride",
    [
        (1000, 64, 32),
        (1000, 64, 1),
        (1000, 64, 63),
        (65, 64, 32),
        (64, 64, 16),
        (63, 64, 8),
        (66, 64, 63),
        (2, 64, 63),
        (2, 2, 1),
        (10, 2, 1),
        (11, 4, 3),
        (100, 7, 5),
        (101, 10, 7),
    ],
)
def test_every_token_after_the_first_scored_once(n, seq_len, stride):
    ctx = _contexts(n, seq_len, stride)
    assert sorted(ctx) == list(range(1, n))
    assert all(1 <= c <= seq_len - 1 for c in ctx.values())
    for t, c in ctx.items():  # past the first window every token has at least L - S context
        assert c >= min(t, seq_len - stride)
    windows = sliding_windows(n, seq_len, stride)
    assert windows[0].begin == 0 and windows[-1].end == n
    assert all(w.length == min(n, seq_len) for w in windows)  # full windows, the last one too
    assert all(0 < w.n_scored <= (seq_len - 1 if i == 0 else stride) for i, w in enumerate(windows))


def _triples(n, seq_len, stride):
    return [(x.begin, x.end, x.score_from) for x in sliding_windows(n, seq_len, stride)]


def test_windows_by_hand():
    # n=6, L=4, S=2 (the HF guide's windows): [0,4) scores 1..3, [2,6) scores 4..5
    assert _triples(6, 4, 2) == [(0, 4, 1), (2, 6, 4)]
    # n shorter than L: one window, all tokens
    assert _triples(3, 8, 4) == [(0, 3, 1)]
    # exactly one window
    assert _triples(8, 8, 4) == [(0, 8, 1)]
    # the last window ends at the text's end and is full length: [0,4), [3,7), [4,8)
    assert _triples(8, 4, 3) == [(0, 4, 1), (3, 7, 4), (4, 8, 7)]
    # stride 1: one new target per window
    assert _triples(5, 3, 1) == [(0, 3, 1), (1, 4, 3), (2, 5, 4)]


@pytest.mark.parametrize(
    "n, seq_len, stride, match",
    [
        (10, 1, 1, "seq_len"),
        (10, 4, 5, "stride"),
        (10, 4, 4, "stride"),
        (10, 4, 0, "stride"),
        (1, 4, 2, "at least 2 tokens"),
        (0, 4, 2, "at least 2 tokens"),
    ],
)
def test_bad_window_settings(n, seq_len, stride, match):
    with pytest.raises(ValueError, match=match):
        sliding_windows(n, seq_len, stride)


def test_hand_computed_fixed_logits():
    # After token 0 the model says (1/2, 1/2); after token 1 it says (3/4, 1/4).
    table = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    ids = torch.tensor([0, 1, 1, 0])
    # targets: 1 after 0 (p=1/2), 1 after 1 (p=1/4), 0 after 1 (p=3/4)
    want = (0.5 * 0.25 * 0.75) ** (-1 / 3)
    for seq_len, stride, batch in [(4, 3, 1), (2, 1, 1), (2, 1, 3), (3, 1, 2), (3, 2, 2), (8, 3, 1)]:
        res = sliding_window_perplexity(FixedLogitsLM(table), ids, seq_len, stride, batch, progress=False)
        assert res.ppl == pytest.approx(want, rel=1e-6), (seq_len, stride, batch)
        assert res.n_scored == 3 and res.n_tokens == 4


class PositionLM(torch.nn.Module):
    """Vocab 2; at window position p predicts token 1 with probability (p+1)/(p+2), i.e.
    c/(c+1) for a target with c context tokens: the loss reveals each target's context."""

    config = SimpleNamespace(vocab_size=2, max_position_embeddings=10_000)

    def forward(self, input_ids, **kwargs):
        b, s = input_ids.shape
        logits = torch.zeros(b, s, 2, dtype=torch.float64)
        logits[:, :, 1] = torch.log(torch.arange(1, s + 1, dtype=torch.float64))
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize(
    "n, seq_len, stride, contexts",
    [
        (6, 4, 2, [1, 2, 3, 2, 3]),  # the HF-guide windows above
        (7, 4, 3, [1, 2, 3, 1, 2, 3]),  # windows [0,4), [3,7): one token of overlap
        (5, 8, 4, [1, 2, 3, 4]),  # shorter than one window
        (8, 4, 3, [1, 2, 3, 1, 2, 3, 3]),  # last window [4,8) is full length: its target gets 3
        (7, 3, 1, [1, 2, 2, 2, 2, 2]),  # stride 1: full context L-1 for every token past the first window
    ],
)
def test_context_lengths_by_hand(n, seq_len, stride, contexts):
    ids = torch.ones(n, dtype=torch.long)
    want_nll = -sum(math.log(c / (c + 1)) for c in contexts) / len(contexts)
    for batch in (1, 2, 5):
        res = sliding_window_perplexity(PositionLM(), ids, seq_len, stride, batch, progress=False)
        assert res.nll == pytest.approx(want_nll, rel=1e-6)
        assert res.n_scored == n - 1


def test_matches_hf_loss_on_a_single_window():
    model = tiny_llama(seed=1)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_loss = float(model(ids[None], labels=ids[None]).loss)
    res = sliding_window_perplexity(model, ids, seq_len=64, stride=32, progress=False)
    assert res.n_windows == 1
    assert res.nll == pytest.approx(hf_loss, rel=1e-5)


def test_batching_and_padding_do_not_change_the_result():
    model = tiny_llama(seed=2)
    ids = torch.randint(0, 128, (203,), generator=torch.Generator().manual_seed(1))
    results = [sliding_window_perplexity(model, ids, 32, 12, b, progress=False) for b in (1, 3, 64)]
    for r in results[1:]:
        assert r.nll == pytest.approx(results[0].nll, rel=1e-6)
    again = sliding_window_perplexity(model, ids, 32, 12, 3, progress=False)
    assert again.nll == results[1].nll  # deterministic


def test_right_padding_of_unequal_windows_is_exact():
    model = tiny_llama(seed=4)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3))
    windows = [Window(0, 12, 1), Window(5, 40, 12), Window(30, 33, 31)]
    together = window_nll(model, ids, windows, "cpu")
    alone = torch.cat([window_nll(model, ids, [w], "cpu") for w in windows])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


class _NoLogitsToKeep(torch.nn.Module):
    """Hides `logits_to_keep` from the evaluator: logits for every position."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, **kwargs):
        return self.inner(input_ids=input_ids, use_cache=False)


def test_skipping_unscored_logits_changes_nothing():
    model = tiny_llama(seed=6)
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(4))
    windows = sliding_windows(150, 32, 8)[1:4]  # equal lengths, 8 targets each
    fast = window_nll(model, ids, windows, "cpu")
    full = window_nll(_NoLogitsToKeep(model), ids, windows, "cpu")
    torch.testing.assert_close(fast, full, rtol=1e-5, atol=1e-6)
    a = sliding_window_perplexity(model, ids, 32, 8, 4, progress=False)
    b = sliding_window_perplexity(_NoLogitsToKeep(model), ids, 32, 8, 4, progress=False)
    assert a.nll == pytest.approx(b.nll, rel=1e-6)


def test_overflowing_perplexity_is_inf():
    table = torch.tensor([[0.0, -2000.0], [0.0, -2000.0]])  # token 1 is (numerically) impossible
    res = sliding_window_perplexity(FixedLogitsLM(table), torch.tensor([0, 1, 1]), 4, 2, progress=False)
    assert res.ppl == math.inf and res.nll > 700


def test_both_models_see_identical_token_ids():
    ids = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(2))
    a, b = RecordingLM(), RecordingLM()
    ra = sliding_window_perplexity(a, ids, 32, 16, 4, progress=False)
    rb = sliding_window_perplexity(b, ids, 32, 16, 4, progress=False)
    assert len(a.seen) == len(b.seen) > 1
    assert all(torch.equal(x, y) for x, y in zip(a.seen, b.seen))
    assert ra.ppl == pytest.approx(128.0) and rb.ppl == pytest.approx(128.0)  # uniform over the vocab
    # the windows fed are slices of ids
    assert torch.equal(a.seen[0][0], ids[:32])


def test_short_text_and_bad_inputs():
    model = tiny_llama(seed=3)
    res = sliding_window_perplexity(model, torch.tensor([5, 7]), 16, 8, progress=False)
    assert res.n_scored == 1 and res.n_windows == 1 and math.isfinite(res.ppl)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sliding_window_perplexity(model, torch.tensor([5]), 16, 8, progress=False)
    with pytest.raises(ValueError, match="1-D"):
        sliding_window_perplexity(model, torch.zeros(2, 8, dtype=torch.long), 16, 8, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        sliding_window_perplexity(model, torch.arange(10), 16, 8, batch_size=0, progress=False)


def test_progress_bar_uses_desc(capsys):
    sliding_window_perplexity(
        RecordingLM(), torch.arange(100) % 128, 16, 8, progress=True, desc="ppl unit-test"
    )
    assert "ppl unit-test" in capsys.readouterr().err
