"""olmo_eqx against AI2's OLMo-core itself: the same weights, batches and same-named settings.

    python scripts/olmo_core_parity.py [--model olmo3_tiny_gqa] [--steps 40] [--warmup 5]
        [--spike-at 30] [--window 16] [--bf16] [--decay-embedding] [--no-z-loss]

OLMo-core's side is its own Trainer, TransformerTrainModule (cross-entropy + z-loss, clipping),
skip-step AdamW (the embedding in a no-decay group, as its official OLMo 3 scripts) and
CosWithWarmup scheduler; ours is the library's train step (tests/olmo_core_reference.py).
Prints the per-step table and the max relative differences. --decay-embedding, --no-z-loss and
--olmo-core-warmup change OLMo-core's side only, to show what a recipe error looks like in the
same figures.
Needs the test extra (torch, ai2-olmo-core).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from olmo_core_reference import run_against_olmo_core  # noqa: E402

from olmo_eqx.train.optim import OptimConfig  # noqa: E402
from olmo_eqx.train.schedules import ScheduleConfig  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo3_tiny_gqa", help="a zoo name, or olmo3_small_test (the suite's)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--spike-at", type=int, default=None, help="0-based step given a one-token batch")
    parser.add_argument("--window", type=int, default=16, help="skip-step window (0: plain AdamW)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute (float32 weights and moments)")
    parser.add_argument("--decay-embedding", action="store_true")
    parser.add_argument("--no-z-loss", action="store_true")
    parser.add_argument("--olmo-core-warmup", type=int, default=None,
                        help="OLMo-core's side only: another warmup (e.g. the old one-step shift)")
    args = parser.parse_args()

    optim = OptimConfig(lr=args.lr, skip_step_window=max(args.window, 1), skip_step_std=6.0 if args.window else None)
    schedule = ScheduleConfig(name="cosine", warmup_steps=args.warmup, final_lr_ratio=0.1)
    changes = {"decay_embedding": args.decay_embedding, "z_loss": not args.no_z_loss}
    if args.olmo_core_warmup is not None:
        changes["schedule"] = ScheduleConfig(name="cosine", warmup_steps=args.olmo_core_warmup, final_lr_ratio=0.1)
    with tempfile.TemporaryDirectory() as workdir:
        result = run_against_olmo_core(
            Path(workdir), optim, schedule, model=args.model, steps=args.steps, spike_at=args.spike_at,
            seq=args.seq, batch=args.batch, compute_dtype="bfloat16" if args.bf16 else "float32",
            olmo_core_changes=changes,
        )
    ours, ref = result.ours["run"], result.torch["run"]
    print(f"{'step':>4} {'lr (ours)':>10} {'lr (OLMo-core)':>14} {'loss (ours)':>11} {'loss (OLMo-core)':>16} "
          f"{'gnorm (ours)':>12} {'gnorm (OLMo-core)':>17} skipped")
    for i in range(args.steps):
        print(f"{i + 1:4d} {ours.lrs[i]:10.4e} {ref.lrs[i]:14.4e} {ours.losses[i]:11.6f} {ref.losses[i]:16.6f} "
              f"{ours.grad_norms[i]:12.6f} {ref.grad_norms[i]:17.6f} {int(ours.skipped[i])}/{int(ref.skipped[i])}")
    weights = result.weight_differences("run")
    worst = max(weights, key=weights.get)
    print(f"\nmax relative difference over {args.steps} steps ({args.model}, {'bf16' if args.bf16 else 'float32'} compute):")
    for metric in ("lrs", "losses", "grad_norms"):
        print(f"  {metric:11} {result.max_relative('run', metric):.2e}")
    print(f"  weights     {weights[worst]:.2e} ({worst})")
    others = {name: d for name, d in weights.items() if name != worst}
    second = max(others, key=others.get)
    print(f"              {others[second]:.2e} ({second}, the next worst)")
    print(f"  skipped     ours {[i + 1 for i, s in enumerate(ours.skipped) if s]}, "
          f"OLMo-core {[i + 1 for i, s in enumerate(ref.skipped) if s]}")


if __name__ == "__main__":
    main()
