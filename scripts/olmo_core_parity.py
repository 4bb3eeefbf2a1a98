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

import numpy as np  # noqa: E402
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
    parser.add_argument("--no-noise-floor", action="store_true",
                        help="skip the second run of our side from weights one ulp away")
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
            olmo_core_changes=changes, noise_floor=not args.no_noise_floor,
        )
    ours, ref = result.ours["run"], result.torch["run"]
    print(f"{'step':>4} {'lr (ours)':>10} {'lr (OLMo-core)':>14} {'loss (ours)':>11} {'loss (OLMo-core)':>16} "
          f"{'gnorm (ours)':>12} {'gnorm (OLMo-core)':>17} skipped")
    for i in range(args.steps):
        print(f"{i + 1:4d} {ours.lrs[i]:10.4e} {ref.lrs[i]:14.4e} {ours.losses[i]:11.6f} {ref.losses[i]:16.6f} "
              f"{ours.grad_norms[i]:12.6f} {ref.grad_norms[i]:17.6f} {int(ours.skipped[i])}/{int(ref.skipped[i])}")
    keys = ("run", "noise", "noise_ours") if "noise" in result.ours else ("run",)
    print(f"\nmax relative difference over {args.steps} steps ({args.model}, {'bf16' if args.bf16 else 'float32'} compute)")
    print(f"  {'':20} {'ours vs OLMo-core':>18}" + ("  OLMo-core vs itself  ours vs itself" if len(keys) > 1 else ""))
    for metric, label in (("lrs", "learning rate"), ("losses", "loss"), ("grad_norms", "grad norm")):
        print(f"  {label:20}" + "".join(f" {result.max_relative(key, metric):18.2e}" for key in keys))
    recorded = np.asarray(ref.recorded_grad_norms)
    print(f"  {'(OLMo-core reported)':20} {np.max(np.abs(np.asarray(ours.grad_norms) - recorded) / recorded):18.2e}"
          "   (its float32 get_total_norm, which rounds: the row above uses the float64 norm of its gradients)")
    worst = {}
    for key in keys:
        weights = result.weight_differences(key)
        worst[key] = sorted(weights.items(), key=lambda item: item[1], reverse=True)
    for rank, label in ((0, "final weights, worst"), (1, "next worst")):
        print(f"  {label:20}" + "".join(f" {worst[key][rank][1]:18.2e}" for key in keys))
    for key in keys:
        print(f"    {key}: worst {worst[key][0][0]}, next {worst[key][1][0]}")
    print(f"  skipped: ours {[i + 1 for i, s in enumerate(ours.skipped) if s]}, "
          f"OLMo-core {[i + 1 for i, s in enumerate(ref.skipped) if s]}")
    if len(keys) > 1:
        print("\n'itself': the same code from initial weights one float32 ulp away (tests/olmo_core_reference.py "
              "`nudged`), the same batches: float32 rounding alone, the yardstick for the first column")


if __name__ == "__main__":
    main()
