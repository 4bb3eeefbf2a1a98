"""Train olmo_eqx and the PyTorch reference side by side and print both loss curves.

    python scripts/trajectory_parity.py [--model olmo3_tiny] [--seq 128] [--batch 8] [--png curves.png]

Stage 1 is warmup + cosine, stage 2 a linear anneal to 0, both in float32 on the embedded
corpus (see tests/trajectory_harness.py). Needs the test extra (torch, transformers).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from trajectory_harness import STAGE1, STAGE2, Stage, run_both  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="olmo3_tiny")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--stage1-steps", type=int, default=STAGE1.steps)
    parser.add_argument("--stage2-steps", type=int, default=STAGE2.steps)
    parser.add_argument("--png", default="trajectory_parity.png")
    args = parser.parse_args()
    stages = (
        Stage(**{**STAGE1.__dict__, "steps": args.stage1_steps}),
        Stage(**{**STAGE2.__dict__, "steps": args.stage2_steps}),
    )
    with tempfile.TemporaryDirectory() as workdir:
        result = run_both(Path(workdir), model_name=args.model, seq=args.seq, batch=args.batch, stages=stages)
    print(f"{'stage':8} {'step':>4} {'loss (jax)':>11} {'loss (torch)':>12} {'rel diff':>9} "
          f"{'gnorm (jax)':>11} {'gnorm (torch)':>13} {'rel diff':>9}")
    for stage in stages:
        ours, ref = result.ours[stage.name], result.torch[stage.name]
        for i in range(stage.steps):
            dl = abs(ours.losses[i] - ref.losses[i]) / abs(ref.losses[i])
            dg = abs(ours.grad_norms[i] - ref.grad_norms[i]) / abs(ref.grad_norms[i])
            print(f"{stage.name:8} {i:4d} {ours.losses[i]:11.6f} {ref.losses[i]:12.6f} {dl:9.2e} "
                  f"{ours.grad_norms[i]:11.5f} {ref.grad_norms[i]:13.5f} {dg:9.2e}")
        print(f"{stage.name}: max relative loss difference {result.max_relative(stage.name, 'losses'):.2e}, "
              f"grad norm {result.max_relative(stage.name, 'grad_norms'):.2e}")
    worst = max(result.weight_differences(stages[-1].name).items(), key=lambda kv: kv[1])
    print(f"final weights: worst relative difference {worst[1]:.2e} ({worst[0]})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    offset = 0
    for stage in stages:
        steps = range(offset, offset + stage.steps)
        ax.plot(steps, result.ours[stage.name].losses, label=f"olmo_eqx {stage.name}")
        ax.plot(steps, result.torch[stage.name].losses, "--", label=f"PyTorch reference {stage.name}")
        offset += stage.steps
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{args.model}: olmo_eqx vs PyTorch reference (float32)")
    ax.legend()
    fig.savefig(args.png, dpi=120, bbox_inches="tight")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
