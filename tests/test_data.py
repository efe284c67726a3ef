"""Text SPEC resolution (builtin / file / hf:) and seeded calibration windows."""

from __future__ import annotations

import pytest
import torch

from mlakit import data
from mlakit.data import (
    DataSpecError,
    builtin_topic_split,
    calibration_batches,
    calibration_relation,
    load_text,
    split_mix,
    tokenize_text,
)
from tests.eval_helpers import char_tokenizer


def test_builtin_split_is_disjoint_deterministic_and_covers_all_topics():
    from pydoc_data.topics import topics

    split = builtin_topic_split()
    assert set(split["eval"]).isdisjoint(split["calib"])
    assert set(split["eval"]) | set(split["calib"]) == set(topics)
    assert split == builtin_topic_split()
    assert 0 < len(split["eval"]) < len(split["calib"])


def test_builtin_text_per_role():
    ev, cal = load_text("builtin", "eval"), load_text("builtin", "calib")
    assert ev == load_text("builtin", "eval")
    assert len(ev) > 50_000 and len(cal) > 200_000
    # no topic's text appears in both roles
    from pydoc_data.topics import topics

    for key in builtin_topic_split()["eval"]:
        assert topics[key].strip()[:200] not in cal


def test_bad_role():
    with pytest.raises(ValueError, match="role"):
        load_text("builtin", "train")


def test_local_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world\nsecond line", encoding="utf-8")
    assert load_text(str(f), "eval") == "hello world\nsecond line"
    assert load_text(str(f), "calib") == "hello world\nsecond line"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: str(p / "missing.txt"), "no file of that name"),
        (lambda p: str(p), "is a directory"),
        (lambda p: (p / "empty.txt").write_text("  \n") and str(p / "empty.txt"), "gave no text"),
        (lambda p: (p / "bin.txt").write_bytes(b"\xff\xfe\xfa") and str(p / "bin.txt"), "not valid UTF-8"),
        (lambda p: "", "empty"),
    ],
)
def test_bad_specs_name_spec_and_fix(tmp_path, make, match):
    spec = make(tmp_path)
    with pytest.raises(DataSpecError, match=match) as info:
        load_text(spec, "eval")
    assert repr(spec) in str(info.value) or spec == ""
    assert "builtin" in str(info.value) or "UTF-8" in str(info.value) or "one .txt" in str(info.value)
    assert isinstance(info.value, ValueError)


class _FakeDataset:
    def __init__(self, rows, columns=("text",)):
        self.column_names = list(columns)
        self._rows = rows

    def __getitem__(self, key):
        assert key == "text"
        return self._rows


def test_hf_spec_joins_text_column(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        return _FakeDataset(["a", "", "b"])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert load_text("hf:wikitext:wikitext-2-raw-v1:validation", "eval") == "a\n\nb"
    assert load_text("hf:wikitext:wikitext-2-raw-v1", "eval") == "a\n\nb"
    assert load_text("hf:wikitext", "calib") == "a\n\nb"
    assert calls == [
        ("wikitext", "wikitext-2-raw-v1", "validation"),
        ("wikitext", "wikitext-2-raw-v1", "test"),
        ("wikitext", None, "train"),
    ]


def test_hf_unreachable_is_a_clear_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataSpecError) as info:
        load_text("hf:wikitext:wikitext-2-raw-v1:test", "eval")
    msg = str(info.value)
    assert "'hf:wikitext:wikitext-2-raw-v1:test'" in msg and "builtin" in msg and "local text file" in msg


def test_hf_without_text_column(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: _FakeDataset([], columns=("sentence",)))
    with pytest.raises(DataSpecError, match="no 'text' column"):
        load_text("hf:glue:sst2", "eval")


@pytest.mark.parametrize("spec", ["hf:", "hf:a::b", "hf:a:b:c:d"])
def test_hf_malformed(spec):
    with pytest.raises(DataSpecError, match="malformed"):
        load_text(spec, "eval")


def test_calibration_batches_are_seeded_windows():
    tok = char_tokenizer()
    a = calibration_batches(tok, "builtin", n_samples=8, seq_len=32, seed=0)
    b = calibration_batches(tok, "builtin", n_samples=8, seq_len=32, seed=0)
    c = calibration_batches(tok, "builtin", n_samples=8, seq_len=32, seed=1)
    assert a.shape == (8, 32) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    ids = tokenize_text(tok, load_text("builtin", "calib"))
    text_windows = ids.unfold(0, 32, 1)
    for row in a:  # every sample is a contiguous window of the calibration text
        assert (text_windows == row).all(dim=1).any()
    assert len({tuple(r.tolist()) for r in a}) == 8


def test_calibration_text_too_short(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("tiny", encoding="utf-8")
    with pytest.raises(DataSpecError, match="has 4 tokens, fewer than one window of seq_len=16"):
        calibration_batches(char_tokenizer(), str(f), n_samples=2, seq_len=16, seed=0)


def test_calibration_more_samples_than_windows(tmp_path):
    f = tmp_path / "small.txt"
    f.write_text("abcdefgh", encoding="utf-8")
    out = calibration_batches(char_tokenizer(), str(f), n_samples=10, seq_len=6, seed=3)
    assert out.shape == (10, 6)
    assert torch.equal(out, calibration_batches(char_tokenizer(), str(f), n_samples=10, seq_len=6, seed=3))


def test_a_calibration_mix_shares_the_windows_equally_and_in_turns(tmp_path):
    tok = char_tokenizer()
    notes = tmp_path / "notes.txt"
    notes.write_text("a short text of another kind, " * 20, encoding="utf-8")
    alone = calibration_batches(tok, "builtin", n_samples=8, seq_len=16, seed=0)
    mix = calibration_batches(tok, f"builtin, {notes}", n_samples=7, seq_len=16, seed=0)
    assert mix.shape == (7, 16)
    # builtin (4 windows, the remainder) and the notes (3) alternate; builtin draws with the run's seed
    assert torch.equal(mix[0::2], alone[:4])
    note_windows = tokenize_text(tok, notes.read_text()).unfold(0, 16, 1)
    for row in mix[1::2]:
        assert (note_windows == row).all(dim=1).any()
    assert torch.equal(mix, calibration_batches(tok, f"builtin,{notes}", n_samples=7, seq_len=16, seed=0))


def test_a_path_with_a_comma_is_one_spec_and_a_mix_needs_every_entry(tmp_path):
    odd = tmp_path / "a,b.txt"
    odd.write_text("text", encoding="utf-8")
    assert split_mix(str(odd)) == [str(odd)]
    assert split_mix("builtin , x.txt") == ["builtin", "x.txt"]
    with pytest.raises(DataSpecError, match="empty entry.*single commas"):
        split_mix("builtin,,x.txt")
    with pytest.raises(DataSpecError, match="names 2 texts for 1 sequences"):
        calibration_batches(char_tokenizer(), "builtin,builtin", n_samples=1, seq_len=8, seed=0)


def test_a_mix_given_where_one_text_is_read_says_where_mixes_go():
    with pytest.raises(DataSpecError, match=r"only by convert's --calib\. Fix: correct the path, or use --data"):
        load_text("builtin,notes.txt", "eval")


def test_a_bad_entry_of_a_mix_is_named_before_any_text_is_tokenized(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "tokenize_text", lambda *a: pytest.fail("tokenized before every text was read"))
    with pytest.raises(DataSpecError, match=r"'missing.txt' is not 'builtin'.*--calib builtin"):
        calibration_batches(char_tokenizer(), "builtin,missing.txt", n_samples=4, seq_len=8, seed=0, flag="--calib")


def test_what_an_evaluation_text_is_to_the_calibration(tmp_path):
    notes, other = tmp_path / "notes.txt", tmp_path / "other.txt"
    notes.write_text("n", encoding="utf-8")
    other.write_text("o", encoding="utf-8")
    assert calibration_relation(str(notes), f"builtin,{tmp_path}/../{tmp_path.name}/notes.txt") == "calibration text"
    assert calibration_relation("builtin", "builtin") == "calibration source, disjoint part"
    assert calibration_relation("builtin", str(notes)) == "other text"
    assert calibration_relation(str(other), f"builtin,{notes}") == "other text"
    # a dataset's evaluation split (test) is not its calibration split (train) unless named so
    assert calibration_relation("hf:wikitext:raw", "hf:wikitext:raw") == "other text"
    assert calibration_relation("hf:wikitext:raw:train", "hf:wikitext:raw") == "calibration text"
    assert calibration_relation("builtin", "random") is None and calibration_relation("builtin", None) is None


def test_calibration_bad_sizes():
    with pytest.raises(ValueError, match="n_samples"):
        calibration_batches(char_tokenizer(), "builtin", n_samples=0, seq_len=8, seed=0)


def test_module_exports():
    assert set(data.__all__) >= {"DataSpecError", "load_text", "calibration_batches", "split_mix"}
