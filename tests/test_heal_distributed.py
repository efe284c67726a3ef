"""Heal on two CPU processes (DDP over gloo, launched by torchrun and by `accelerate launch`):
disjoint data in one seeded global order, the single-process result at the same global batch,
resume after an interruption under the same and under another process count."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlakit.heal import HealError, HealOptions, heal
from tests.heal_helpers import make_heal_pair, weights

ROOT = Path(__file__).resolve().parents[1]
SEQ, B, STEPS = 16, 2, 6  # B sequences per process; the single-process reference takes 2 * B
LAUNCH_TIMEOUT = 300  # seconds per launch (observed ~10-20 s on 2 shared cores)


def _env() -> dict:
    return os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def _options(teacher: Path, batch: int) -> dict:
    return dict(
        teacher=str(teacher),
        data="random",
        tokens=STEPS * 2 * B * SEQ,
        seq_len=SEQ,
        batch_size=batch,
        lr=2e-3,
        save_every=2,
        quiet=True,
    )


def test_two_processes_match_one_and_resume(tmp_path):
    teacher, conv = make_heal_pair(tmp_path)
    # the reference: one process, the same global batch of 2 * B sequences
    ref_batches: dict[int, list[torch.Tensor]] = {}
    ref = heal(
        conv,
        tmp_path / "ref",
        HealOptions(**_options(teacher, 2 * B)),
        on_batch=lambda step, ids: ref_batches.setdefault(step, []).append(ids.clone()),
    )

    # two processes, stopped after step 3 (checkpoint at step 2: step 3 is lost)
    dest, log = tmp_path / "two", tmp_path / "log"
    log.mkdir()
    spec = {
        "out": str(conv),
        "dest": str(dest),
        "options": _options(teacher, B),
        "log": str(log),
        "stop_after": 3,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = _run([*worker, str(ROOT / "tests" / "heal_worker.py"), str(tmp_path / "spec.json")])
    assert result.returncode != 0, "the worker should have stopped after step 3"
    assert "exitcode  : 3" in result.stderr, result.stderr[-3000:]
    assert not dest.exists(), "an interrupted run must not leave DEST"
    work = tmp_path / "two.heal-work"
    assert (work / "step-0000002").is_dir()

    # the two processes trained on disjoint halves of the reference's global batches, in its order
    seen = [torch.load(log / f"batches-{rank}.pt") for rank in (0, 1)]
    assert [s for s, _ in seen[0]] == [s for s, _ in seen[1]] == [1, 2, 3]
    for (step, ids0), (_, ids1) in zip(*seen):
        rows0, rows1 = {tuple(r.tolist()) for r in ids0}, {tuple(r.tolist()) for r in ids1}
        assert len(rows0) == len(rows1) == B and not rows0 & rows1, f"step {step}: the processes overlap"
        assert torch.equal(torch.cat([ids0, ids1]), ref_batches[step][0]), (
            f"step {step}: not the global order"
        )

    shutil.copytree(work, tmp_path / "one.heal-work")  # the same checkpoint, resumed below by one process

    # resume under `accelerate launch` (the user's command line), two processes
    port = str(_free_port())
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        port,
    ]
    flags = ["--teacher", teacher, "--data", "random", "--tokens", STEPS * 2 * B * SEQ, "--seq-len", SEQ]
    flags += ["--batch-size", B, "--lr", 2e-3, "--save-every", 2, "--resume", "-q"]
    result = _run([*launch, "-m", "mlakit.cli", "heal", str(conv), str(dest), *map(str, flags)])
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((dest / "conversion.json").read_text())["heal"]
    assert two["processes"] == 2 and two["distributed"] == "MULTI_CPU" and two["resumed"]
    assert [p["tokens"] for p in two["per_process"]] == [(STEPS - 2) * B * SEQ] * 2  # steps 3-6, each process
    assert all(p["tokens_per_second"] > 0 for p in two["per_process"])
    assert not work.exists()
    _assert_same_run("2 processes", two, dest, ref, tmp_path / "ref")

    # another process count: one process resumes the two-process checkpoint at the same global batch
    with pytest.raises(HealError, match=r"sequences_per_step: checkpoint 4 vs now 2.*--batch-size"):
        heal(conv, tmp_path / "one", HealOptions(**_options(teacher, B), resume=True))
    one = heal(conv, tmp_path / "one", HealOptions(**_options(teacher, 2 * B), resume=True))
    assert one["processes"] == 1 and one["resumed"]
    _assert_same_run("resumed by 1 process", one, tmp_path / "one", ref, tmp_path / "ref")


def _assert_same_run(what: str, got: dict, got_dir: Path, want: dict, want_dir: Path) -> None:
    """The single-process reference's result up to float summation order (DDP averages two
    half-batch gradients where one process sums one batch): bounds 1e-5 relative on the loss
    curve, 1e-4 absolute on weights of scale ~0.5 (observed: see the assertion messages)."""
    got_loss = torch.tensor([loss for _, loss in got["loss_history"]])
    want_loss = torch.tensor([loss for _, loss in want["loss_history"]])
    assert [s for s, _ in got["loss_history"]] == list(range(1, STEPS + 1))
    loss_err = float(((got_loss - want_loss).abs() / want_loss.abs()).max())
    assert loss_err < 1e-5, f"{what}: loss curve differs by {loss_err:.2e} relative"
    print(f"{what}: loss curve {loss_err:.2e} relative", end="; ")
    before, after = want["heldout_before"]["kl"], want["heldout_after"]["kl"]
    assert after < 0.9 * before, f"the reference did not train: held-out KL {before:.4f} -> {after:.4f}"
    a, b = weights(got_dir), weights(want_dir)
    w_err = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert w_err < 1e-4, f"{what}: weights differ by up to {w_err:.2e}"
    print(f"weights {w_err:.2e} absolute", end="; ")
    kl_err = abs(got["heldout_after"]["kl"] - want["heldout_after"]["kl"]) / want["heldout_after"]["kl"]
    assert kl_err < 1e-4, f"{what}: held-out KL differs by {kl_err:.2e} relative"
    print(f"held-out KL {kl_err:.2e} relative")


def test_fsdp_on_cpu_is_refused_not_silently_replicated():
    """accelerate's FSDP needs GPUs; on CPU it would run the launch as plain data parallel. (A
    subprocess: accelerate's state is a per-process singleton.)"""
    code = "from mlakit.heal.trainer import make_accelerator; make_accelerator()"
    env = _env() | {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "HealError" in result.stderr and "drop --use_fsdp" in result.stderr
