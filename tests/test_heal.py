"""Healing by distillation: loss, data stream, training loop, exact resume, CLI (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig, LlamaForCausalLM

from mlakit import load_converted
from mlakit.cli import cli
from mlakit.heal import HealError, HealOptions, PackedSequences, distill_loss, heal
from mlakit.heal.schedule import cosine_with_warmup, select_trainable
from tests.heal_helpers import make_heal_pair, weights
from tests.tiny_models import assert_close

SEQ, BATCH = 16, 4
TINY = dict(data="random", seq_len=SEQ, batch_size=BATCH, val_sequences=8, quiet=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_heal_pair(tmp_path_factory.mktemp("heal"))


# -- loss ------------------------------------------------------------------------------------


def test_chunked_loss_and_gradients_match_one_chunk():
    """Chunking (with recomputation in backward) changes neither the loss nor the gradient."""
    torch.manual_seed(0)
    head_s, head_t = torch.nn.Linear(8, 50, bias=False), torch.nn.Linear(8, 50, bias=False)
    ids = torch.randint(0, 50, (3, 11))
    h_t = torch.randn(3, 11, 8)
    results = []
    for chunk in (10_000, 4):  # one chunk; 4 // 3 = 1 position per chunk -> 11 chunks
        h_s = torch.randn(3, 11, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        head_s.zero_grad()
        out = distill_loss(h_s, h_t, ids, head_s, head_t, temperature=2.0, lm_weight=0.5, chunk_tokens=chunk)
        out.loss.backward()
        results.append((out.loss.detach(), h_s.grad.clone(), head_s.weight.grad.clone()))
    for name, got, want in zip(("loss", "grad h", "grad head"), results[1], results[0]):
        assert_close(name, got, want, atol=1e-6, rtol=1e-5)


def test_kl_is_zero_for_identical_models_and_matches_definition():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 30, bias=False)
    ids = torch.randint(0, 30, (2, 5))
    h = torch.randn(2, 5, 8)
    head.requires_grad_(False)
    assert distill_loss(h, h, ids, head, head).kl == pytest.approx(0.0, abs=1e-6)
    h2 = torch.randn(2, 5, 8)
    T = 1.5
    p_t = torch.softmax(head(h) / T, -1)
    want = (p_t * (torch.log_softmax(head(h) / T, -1) - torch.log_softmax(head(h2) / T, -1))).sum(
        -1
    ).mean() * T**2
    assert distill_loss(h2, h, ids, head, head, temperature=T).kl == pytest.approx(float(want), rel=1e-5)


def test_schedule_warms_up_then_decays_to_a_tenth():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = cosine_with_warmup(opt, warmup_steps=4, total_steps=20)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert sched.get_last_lr()[0] == pytest.approx(0.1)


def test_attention_selection_trains_only_the_mla_projections(pair):
    model = load_converted(pair[1])
    names = select_trainable(model, "attention")
    assert names and all(
        n.split(".")[-2] in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") for n in names
    )
    assert len(names) == sum(p.requires_grad for p in model.parameters())
    assert len(select_trainable(model, "all")) == len(list(model.parameters()))


# -- data ------------------------------------------------------------------------------------


def test_memory_stream_is_seeded_resumable_and_disjoint_from_heldout():
    ids = torch.arange(40 * 8)  # 40 windows of 8 distinct tokens
    data = PackedSequences("t", 8, seed=3, n_val=4, ids=ids)
    it = data.iterate(0)
    first = [next(it) for _ in range(90)]  # crosses two epoch boundaries (36 per epoch)
    it = data.iterate(50)
    assert all(torch.equal(a, next(it)) for a in first[50:])
    epoch = {int(s[0]) for s in first[:36]}
    assert len(epoch) == 36  # each training window once per epoch
    assert epoch.isdisjoint({int(s[0]) for s in data.validation})
    other = PackedSequences("t", 8, seed=4, n_val=4, ids=ids).iterate(0)
    assert not all(torch.equal(a, next(other)) for a in first[:36])


def test_streamed_data_packs_holds_out_and_resumes():
    rows = [list(range(100 * i, 100 * i + 7)) for i in range(60)]  # 60 rows of 7 tokens (+ EOS)
    data = PackedSequences("hf:x", 6, seed=0, n_val=3, stream_factory=lambda epoch: iter(rows), eos_id=-1)
    assert data.validation.shape == (3, 6) and data.validation[0].tolist() == [0, 1, 2, 3, 4, 5]
    it = data.iterate(0)
    first = [next(it) for _ in range(120)]  # 80 packed sequences, 77 trained per epoch
    it = data.iterate(45)
    assert all(torch.equal(a, next(it)) for a in first[45:])
    held = {tuple(s.tolist()) for s in data.validation}
    assert not held & {tuple(s.tolist()) for s in first[:77]}


# -- training --------------------------------------------------------------------------------


def test_heal_lowers_the_heldout_kl(pair, tmp_path):
    """40 steps of 64 tokens: the held-out KL must fall by at least 25% (observed: ~45%)."""
    teacher, conv = pair
    report = heal(
        conv, tmp_path / "healed", HealOptions(teacher=str(teacher), tokens=40 * SEQ * BATCH, lr=2e-3, **TINY)
    )
    before, after = report["heldout_before"]["kl"], report["heldout_after"]["kl"]
    assert before > 0.05, f"the test pair is too close to learn from: KL {before}"
    assert after < 0.75 * before, f"held-out KL {before:.4f} -> {after:.4f}"
    assert report["steps"] == 40 and report["tokens"] == 40 * SEQ * BATCH
    healed = weights(tmp_path / "healed")
    original = weights(conv)
    assert set(healed) == set(original)
    changed = {k for k in healed if not torch.equal(healed[k], original[k])}
    assert changed and all(
        k.split(".")[-2] in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj") for k in changed
    )
    conversion = json.loads((tmp_path / "healed" / "conversion.json").read_text())
    assert conversion["heal"]["settings"]["lr"] == 2e-3 and "layers" in conversion  # convert's report kept
    assert not (tmp_path / "healed.heal-work").exists()


class _Crash(RuntimeError):
    pass


def test_resume_after_interruption_is_bitwise_identical(pair, tmp_path):
    """Checkpoint every 4 steps; crash after step 6 (steps 5-6 lost); resume. Parameters and the
    loss history must equal an uninterrupted run's exactly (bitwise, float32 on CPU)."""
    teacher, conv = pair
    opts = dict(teacher=str(teacher), tokens=12 * SEQ * BATCH, lr=2e-3, save_every=4, **TINY)
    heal(conv, tmp_path / "straight", HealOptions(**opts))

    def crash(step):
        if step == 6:
            raise _Crash

    with pytest.raises(_Crash):
        heal(conv, tmp_path / "resumed", HealOptions(**opts), on_step=crash)
    assert not (tmp_path / "resumed").exists()
    assert (tmp_path / "resumed.heal-work" / "step-0000004").is_dir()
    with pytest.raises(HealError, match="--resume"):  # a checkpoint is there: refuse to silently restart
        heal(conv, tmp_path / "resumed", HealOptions(**opts))
    with pytest.raises(HealError, match="lr: checkpoint 0.002 vs now 0.001"):
        heal(conv, tmp_path / "resumed", HealOptions(**(opts | {"lr": 1e-3}), resume=True))
    report = heal(conv, tmp_path / "resumed", HealOptions(**opts, resume=True))
    assert report["resumed"] and report["steps"] == 12
    want, got = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs after resume"
    straight = json.loads((tmp_path / "straight" / "conversion.json").read_text())["heal"]
    assert report["loss_history"] == straight["loss_history"]


# -- CLI -------------------------------------------------------------------------------------


def _cli(*args):
    return CliRunner().invoke(cli, ["heal", *map(str, args)])


def test_cli_heals_and_the_result_loads(pair, tmp_path):
    teacher, conv = pair
    dest = tmp_path / "healed"
    result = _cli(
        conv,
        dest,
        "--teacher",
        teacher,
        "--data",
        "random",
        "--tokens",
        8 * 64,
        "--seq-len",
        16,
        "--batch-size",
        2,
        "--grad-accum",
        2,
        "--lm-weight",
        0.1,
        "--temperature",
        2,
        "--train",
        "all",
        "-q",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["steps"] == 8 and summary["tokens"] == 512
    heal_report = json.loads((dest / "conversion.json").read_text())["heal"]
    assert heal_report["settings"]["train"] == "all" and heal_report["settings"]["grad_accum"] == 2
    with torch.no_grad():
        logits = load_converted(dest)(torch.randint(0, 96, (1, 8))).logits
    assert logits.shape == (1, 8, 96) and torch.isfinite(logits).all()


def test_cli_errors_name_the_problem_and_fix(pair, tmp_path):
    teacher, conv = pair
    exists = tmp_path / "exists"
    exists.mkdir()
    result = _cli(conv, exists, "--teacher", teacher, "--data", "random")
    assert result.exit_code == 1 and "already exists" in result.output and "--overwrite" in result.output

    result = _cli(conv, tmp_path / "d1", "--teacher", teacher, "--data", "hf:")
    assert result.exit_code == 2 and "--data" in result.output and "malformed" in result.output
    result = _cli(conv, tmp_path / "d2", "--teacher", teacher, "--data", str(tmp_path / "missing.txt"))
    assert result.exit_code == 2 and "no file of that name" in result.output
    result = _cli(
        conv, tmp_path / "d3", "--teacher", teacher, "--data", "builtin"
    )  # tiny models: no tokenizer
    assert result.exit_code == 2 and "tokenizer" in result.output and "random" in result.output

    result = _cli(conv, tmp_path / "d4", "--teacher", teacher, "--data", "random", "--tokens", 10)
    assert result.exit_code == 1 and "less than one optimizer step" in result.output

    result = _cli(teacher, tmp_path / "d5", "--teacher", teacher, "--data", "random")
    assert result.exit_code == 1 and "mla-convert convert" in result.output

    other = tmp_path / "other_vocab"
    cfg = LlamaConfig(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(str(other))
    result = _cli(conv, tmp_path / "d6", "--teacher", other, "--data", "random")
    assert (
        result.exit_code == 1 and "vocabulary of 120 tokens" in result.output and "--teacher" in result.output
    )
    for name in ("d1", "d2", "d3", "d4", "d5", "d6"):  # a failed start leaves no output and no work dir
        assert not (tmp_path / name).exists() and not (tmp_path / f"{name}.heal-work").exists()
