"""Heal throughput against its floor, measured side by side in one run.

    nice -n 5 python bench/heal_floor.py                 # SmolLM2-135M at 81.25% KV reduction

The floor of one heal step is what any distillation must compute: the teacher's forward
(logits, no_grad) plus the student's forward and backward with a plain next-token
cross-entropy, over the same parameters heal trains (``--train``). Against it, heal's own
step split into its parts (teacher hidden states, student body forward, distillation loss
with both heads, backward, clip + AdamW), and ``mla-convert heal``'s Python entry point run
for the same number of steps (its ``train_seconds``). Each round times every variant once,
in turn, on the same batch, so load from other processes on the machine falls on all of
them alike; medians over ``--rounds`` after one warm-up round. Writes heal_floor.json and
heal_floor.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from mlakit.heal import HealOptions, heal
from mlakit.heal.loss import distill_loss
from mlakit.heal.models import load_models, teacher_parts
from mlakit.heal.schedule import select_trainable
from mlakit.pipeline.api import convert
from mlakit.recipes import Recipe


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="default")
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--kv-budget", type=float, default=0.1875)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    ap.add_argument("--train", default="attention", choices=["attention", "all"])
    ap.add_argument("--work", default="runs/heal_bench")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    converted = work / f"converted-{args.kv_budget:g}"  # shared with bench/heal_bench.py
    if not (converted / "config.json").is_file():
        recipe = Recipe.load(args.recipe)
        convert(
            args.source,
            converted,
            recipe.to_options(kv_budget=args.kv_budget, quiet=True, verify=False),
            recipe=recipe,
        )

    device = torch.device("cpu")
    student, teacher, _, vocab = load_models(converted, args.source, device)
    select_trainable(student, args.train)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95))
    base_t, head_t = teacher_parts(teacher)
    base_s = getattr(student, student.base_model_prefix)
    ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    tokens = ids.numel()

    def teacher_logits():
        with torch.no_grad():
            return teacher(input_ids=ids, use_cache=False).logits

    def student_ce():
        student(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.zero_grad(set_to_none=True)

    parts: dict[str, float] = {}

    def heal_step():  # heal's step (trainer._heal), each part timed
        def part(name, fn):
            t = time.perf_counter()
            r = fn()
            parts[name] = time.perf_counter() - t
            return r

        with torch.no_grad():
            ht = part(
                "teacher hidden states", lambda: base_t(input_ids=ids, use_cache=False).last_hidden_state
            )
        hs = part("student body forward", lambda: base_s(input_ids=ids, use_cache=False).last_hidden_state)
        loss = part(
            "distillation loss (both heads, KL, NLL)",
            lambda: distill_loss(hs, ht, ids, student.get_output_embeddings(), head_t, 1.0, 0.0, 4096).loss,
        )
        part("backward", loss.backward)

        def update():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        part("clip + AdamW", update)

    samples: dict[str, list[float]] = {"teacher forward": [], "student fwd+bwd (CE)": [], "heal step": []}
    part_samples: dict[str, list[float]] = {}
    for r in range(args.rounds + 1):
        t_teacher, t_student, t_heal = _timed(teacher_logits), _timed(student_ce), _timed(heal_step)
        if r == 0:
            continue  # warm-up
        samples["teacher forward"].append(t_teacher)
        samples["student fwd+bwd (CE)"].append(t_student)
        samples["heal step"].append(t_heal)
        for k, v in parts.items():
            part_samples.setdefault(k, []).append(v)
        print(
            f"round {r}: teacher {t_teacher:.2f} s, student {t_student:.2f} s, heal step {t_heal:.2f} s",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in samples.items()}
    part_med = {k: statistics.median(v) for k, v in part_samples.items()}
    floor = med["teacher forward"] + med["student fwd+bwd (CE)"]

    # the real entry point, as many steps (it reloads both models; its train_seconds cover steps only)
    n_steps = args.rounds
    report = heal(
        converted,
        work / "heal-floor-run",
        HealOptions(
            teacher=args.source,
            data="random",
            tokens=n_steps * tokens,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            train=args.train,
            val_sequences=1,
            warmup=1,
            lr=1e-6,
            overwrite=True,
            quiet=True,
        ),
    )
    heal_cli = report["train_seconds"] / report["steps"]

    result = {
        "source": args.source,
        "recipe": args.recipe,
        "kv_budget": args.kv_budget,
        "batch": [args.batch_size, args.seq_len],
        "tokens_per_step": tokens,
        "train": args.train,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()],  # other users of the cores
        "median_seconds": med | {"floor (teacher forward + student fwd+bwd)": floor, "heal() step": heal_cli},
        "heal_step_parts_median_seconds": part_med,
        "tokens_per_second": {
            "floor": tokens / floor,
            "heal step (timed parts)": tokens / med["heal step"],
            "heal()": tokens / heal_cli,
        },
        "heal_over_floor": heal_cli / floor,
        "samples_seconds": samples | {"heal step parts": part_samples},
    }
    (out / "heal_floor.json").write_text(json.dumps(result, indent=2) + "\n")
    cmd = (
        f"nice -n 5 python bench/heal_floor.py --kv-budget {args.kv_budget:g} --seq-len {args.seq_len} "
        f"--batch-size {args.batch_size} --rounds {args.rounds} --train {args.train}"
    )
    md = [
        f"Heal floor bench: {args.source} converted with `{args.recipe}` at --kv-budget {args.kv_budget:g}, "
        f"--train {args.train}, batch {args.batch_size} x {args.seq_len} = {tokens} tokens per step, "
        f"{torch.get_num_threads()} CPU threads on a shared machine (load average at the end "
        f"{os.getloadavg()[0]:.1f}); medians of {args.rounds} rounds (variants interleaved per round).",
        "",
        "| what | seconds/step | tokens/s |",
        "|---|---|---|",
        f"| teacher forward (logits, no_grad) | {med['teacher forward']:.2f} | |",
        f"| student forward + backward, plain CE | {med['student fwd+bwd (CE)']:.2f} | |",
        f"| **floor** (sum of the two) | {floor:.2f} | {tokens / floor:.0f} |",
        f"| heal step, parts timed | {med['heal step']:.2f} | {tokens / med['heal step']:.0f} |",
        f"| `heal()` ({report['steps']} steps, train_seconds) | {heal_cli:.2f} | {tokens / heal_cli:.0f} |",
        "",
        f"heal() / floor: **{heal_cli / floor:.2f}x**. Heal step by part (median seconds):",
        "",
        "| part | seconds |",
        "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in part_med.items()),
        "",
        f"Command: `{cmd}`",
        "",
    ]
    (out / "heal_floor.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
