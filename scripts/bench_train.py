"""Our CPU train step against HF transformers' PyTorch OLMo 3 on the same model, side by side.

    python scripts/bench_train.py                    # 12.6M OLMo 3, batch 8 x 256, 3 rounds
    python scripts/bench_train.py --rounds 5 --steps 8
    python scripts/bench_train.py --profile          # our step's top ops by time (XLA:CPU trace)
    taskset -c 0 python scripts/bench_train.py       # one core
    python scripts/bench_train.py --no-huge-pages    # glibc's malloc as it comes, both sides

The model (vocab 8192, d_model 256, 4 heads, 8 layers, MLP 1024, window 128) starts from one
initialisation on both sides; both train on the same batch with the same recipe: cross-entropy
+ z-loss over target tokens, global-norm clipping at 1.0, AdamW (embedding not decayed), float32.
Each side lives in its own process, built and warmed up once; the parent then alternates them
(ours, then PyTorch, `--rounds` times), so only one side runs at a time and neither side's
thread pool competes with the other's. Printed per side: median train tokens/s over every
timed step, forward and forward+backward seconds, and the MFU against the matmul peak each
framework reaches on a 2048^2 float32 matmul on this machine.

The PyTorch side needs the test extras (`pip install -e '.[test]'`); without them only ours runs.
"""

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(
    name="bench_12m", vocab_size=8192, padded_vocab_size=8192, d_model=256, n_layers=8, n_heads=4, n_kv_heads=4,
    head_dim=64, mlp_hidden=1024, sliding_window=128, max_sequence_length=256,
)
LR, Z_LOSS, CLIP = 1e-4, 1e-5, 1.0  # a small constant lr: timing only, the loss stays finite
PEAK_SIZE = 2048


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# The two sides: each builds its model, state and batch, warms up (compiles), and then times
# `train(n)` (n step times), `forward(n)` / `backward(n)` (medians) and `peak()` (GFLOP/s).


class Ours:
    def __init__(self, model_dir: str, batch_file: str):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from olmo_eqx.batch import TokenBatch
        from olmo_eqx.interop.hf import load_hf
        from olmo_eqx.models.base import unconstrained
        from olmo_eqx.train.loss import objective, target_count
        from olmo_eqx.train.optim import OptimConfig, make_optimizer
        from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
        from olmo_eqx.train.state import new_train_state
        from olmo_eqx.train.step import make_train_step, model_loss_sums

        self.jax = jax
        model = load_hf(model_dir, attention_impl=os.environ.get("BENCH_ATTENTION", "auto"))
        optim = OptimConfig(lr=LR, z_loss_weight=Z_LOSS, clip_grad_norm=CLIP, skip_step_std=None)
        schedule = make_schedule(ScheduleConfig(name="constant"), optim.lr, 10_000)
        self.state = new_train_state(model, make_optimizer(optim), optim.skip_step_window)
        ids = np.load(batch_file)
        self.batch = TokenBatch(jnp.asarray(ids), jnp.ones(ids.shape, jnp.float32))
        self.step = make_train_step(optim, schedule)

        def loss(model, batch):
            return objective(model_loss_sums(model, batch, unconstrained), Z_LOSS, target_count(batch.loss_mask))

        self._forward, self._backward = jax.jit(loss), jax.jit(jax.grad(loss))
        self.matrix = jnp.ones((PEAK_SIZE, PEAK_SIZE), jnp.float32)
        self._matmul = jax.jit(lambda x: x @ x)
        for _ in range(2):  # compile and warm up
            self.loss = self.train(1)[1]
            self.forward(1), self.backward(1), self.peak()

    def train(self, n: int) -> tuple[list[float], float]:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            self.state, metrics = self.step(self.state, self.batch)
            self.jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
        return times, float(metrics["loss"])

    def forward(self, n: int) -> float:
        return _median_seconds(lambda: self.jax.block_until_ready(self._forward(self.state.model, self.batch)), n)

    def backward(self, n: int) -> float:
        return _median_seconds(lambda: self.jax.block_until_ready(self._backward(self.state.model, self.batch)), n)

    def peak(self) -> float:
        seconds = _median_seconds(lambda: self.jax.block_until_ready(self._matmul(self.matrix)), 10)
        return 2 * PEAK_SIZE**3 / seconds / 1e9


class PyTorch:
    def __init__(self, model_dir: str, batch_file: str):
        import numpy as np
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        embedding = self.model.get_input_embeddings().weight
        groups = [{"params": [p for p in self.model.parameters() if p is not embedding], "weight_decay": 0.1},
                  {"params": [embedding], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
        self.ids = torch.as_tensor(np.load(batch_file).astype(np.int64))
        self.matrix = torch.ones((PEAK_SIZE, PEAK_SIZE), dtype=torch.float32)
        for _ in range(2):
            self.loss = self.train(1)[1]

    def _loss(self):
        torch, ids = self.torch, self.ids
        logits = self.model(ids).logits[:, :-1].float()
        lse = torch.logsumexp(logits, dim=-1)
        ce = lse - torch.gather(logits, -1, ids[:, 1:, None])[..., 0]
        return (ce.sum() + Z_LOSS * (lse * lse).sum()) / ce.numel(), ce.mean()

    def train(self, n: int) -> tuple[list[float], float]:
        times = []
        for _ in range(n):
            started = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            value, ce = self._loss()
            value.backward()
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
            self.optimizer.step()
            loss = ce.item()
            times.append(time.perf_counter() - started)
        return times, loss

    def forward(self, n: int) -> float:
        def run():
            with self.torch.no_grad():
                self._loss()[0].item()

        return _median_seconds(run, n)

    def backward(self, n: int) -> float:
        def run():
            self.model.zero_grad(set_to_none=True)
            self._loss()[0].backward()

        return _median_seconds(run, n)

    def peak(self) -> float:
        return 2 * PEAK_SIZE**3 / _median_seconds(lambda: self.matrix @ self.matrix, 10) / 1e9


def serve(connection, side: str, model_dir: str, batch_file: str) -> None:
    """A side in its own process: build it, say ready, then run (method, *args) until None."""
    worker = {"olmo_eqx": Ours, "pytorch": PyTorch}[side](model_dir, batch_file)
    connection.send(worker.loss)
    while (command := connection.recv()) is not None:
        connection.send(getattr(worker, command[0])(*command[1:]))


# ---------------------------------------------------------------------------------------------


def train_flops_per_token(seq: int) -> float:
    """6 x the matmul parameters (every weight but the input embedding) plus attention's
    score and value matmuls (3 x 4 x d x keys seen, averaged over positions)."""
    d, layers, hidden, vocab = MODEL["d_model"], MODEL["n_layers"], MODEL["mlp_hidden"], MODEL["vocab_size"]
    matmul_params = layers * (4 * d * d + 3 * d * hidden) + d * vocab
    window = MODEL["sliding_window"]
    keys = 0.0
    for layer in range(layers):
        full = layer % 4 == 3
        keys += sum((t + 1) if full else min(t + 1, window) for t in range(seq)) / seq
    return 6 * matmul_params + 12 * d * keys


def _start(side: str, model_dir: str, batch_file: str):
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=serve, args=(child, side, model_dir, batch_file), daemon=True)
    process.start()
    return process, parent


def _call(connection, *command):
    connection.send(command)
    return connection.recv()


def compare(args) -> None:
    sides = ["olmo_eqx"]
    if all(importlib.util.find_spec(name) for name in ("torch", "transformers")):
        sides.append("pytorch")
    else:
        print("transformers/torch not installed (pip install -e '.[test]'): timing olmo_eqx alone")
    tokens = args.batch * args.seq
    results = {side: {"times": []} for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        _write_inputs(tmp, args)
        # One side at a time, also while building: compiling competes for the same cores.
        workers = {}
        for side in sides:
            workers[side] = _start(side, tmp, f"{tmp}/batch.npy")
            print(f"{side}: ready (loss after 2 steps {workers[side][1].recv():.4f})", flush=True)
        for round_ in range(args.rounds):
            line = []
            for side, (_, connection) in workers.items():
                times, _ = _call(connection, "train", args.steps)
                results[side]["times"] += times
                line.append(f"{side} {tokens / statistics.median(times):,.0f} tok/s")
            print(f"round {round_ + 1}/{args.rounds}: " + " | ".join(line), flush=True)
        for side, (process, connection) in workers.items():
            results[side]["forward"] = _call(connection, "forward", args.steps)
            results[side]["backward"] = _call(connection, "backward", args.steps)
            results[side]["peak"] = _call(connection, "peak")
            connection.send(None)
            process.join()

    flops = train_flops_per_token(args.seq) * tokens
    print(f"\nOLMo 3 {MODEL['name']} (12.6M), batch {args.batch} x {args.seq}, float32, "
          f"{len(os.sched_getaffinity(0))} cores, {args.rounds} rounds x {args.steps} steps per side")
    print(f"{'':10} {'train tok/s':>12} {'step s':>8} {'forward s':>10} {'fwd+bwd s':>10} {'bwd/fwd':>8} "
          f"{'matmul peak':>12} {'MFU':>6}")
    for side, r in results.items():
        step = statistics.median(r["times"])
        print(f"{side:10} {tokens / step:12,.0f} {step:8.3f} {r['forward']:10.3f} {r['backward']:10.3f} "
              f"{r['backward'] / r['forward']:8.1f} {r['peak']:7.0f} GF/s {flops / step / 1e9 / r['peak']:6.1%}")
    if len(results) == 2:
        ours, theirs = results["olmo_eqx"]["times"], results["pytorch"]["times"]
        per_round = [
            statistics.median(theirs[i * args.steps:(i + 1) * args.steps])
            / statistics.median(ours[i * args.steps:(i + 1) * args.steps])
            for i in range(args.rounds)
        ]
        print(f"\nolmo_eqx / pytorch train tokens/s: {statistics.median(theirs) / statistics.median(ours):.2f}x "
              f"(per round: {', '.join(f'{r:.2f}x' for r in per_round)})")


def _write_inputs(directory: str, args) -> None:
    """The shared initial weights (a HF checkpoint both sides load) and the batch."""
    import jax
    import numpy as np

    from olmo_eqx.interop.hf import save_hf
    from olmo_eqx.models.config import ModelConfig
    from olmo_eqx.models.olmo3 import OLMo

    config = ModelConfig(**MODEL)
    save_hf(OLMo(config, key=jax.random.key(0)), directory)
    rng = np.random.default_rng(0)
    np.save(f"{directory}/batch.npy", rng.integers(0, config.vocab_size, (args.batch, args.seq), dtype=np.int32))


# ---------------------------------------------------------------------------------------------
# Profile: where our step's time goes, by XLA op.


def profile(args) -> None:
    # Thunk-level trace events; the flag must be set before JAX starts.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_enable_xprof_traceme=true"
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        _write_inputs(tmp, args)
        ours = Ours(tmp, f"{tmp}/batch.npy")
        trace_dir = Path(tmp) / "trace"
        jax.profiler.start_trace(str(trace_dir))
        times, _ = ours.train(args.steps)
        jax.profiler.stop_trace()
        [xplane] = trace_dir.rglob("*.xplane.pb")
        by_op = op_times(xplane)
    step = statistics.median(times)
    total = sum(by_op.values())
    print(f"our train step: {step:.3f} s median over {args.steps} steps; ops traced: {total / args.steps / 1e6:.0f} ms/step")
    by_kind: dict[str, float] = {}
    for name, ns in by_op.items():
        kind = name.rstrip("0123456789").rstrip(".")
        by_kind[kind] = by_kind.get(kind, 0.0) + ns
    for title, table in (("by kind of op", by_kind), ("by op", by_op)):
        print(f"\ntop {args.top} {title} (ms per step, share of traced op time):")
        for name, ns in sorted(table.items(), key=lambda item: -item[1])[: args.top]:
            print(f"  {ns / args.steps / 1e6:8.1f} ms  {ns / total:6.1%}  {name}")


def op_times(xplane: Path) -> dict[str, float]:
    """Nanoseconds per XLA op name, summed over the trace's host threads (thunk events)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    totals: dict[str, float] = {}
    for plane in data.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for event in line.events:
                name = event.name
                # Thunk events carry the HLO op's name; skip Python/runtime scopes.
                if any(name.startswith(p) for p in ("$", "PjRt", "Thunk", "ThunkExecutor", "jit_", "TfrtCpu")):
                    continue
                totals[name] = totals.get(name, 0.0) + event.duration_ns
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    parser.add_argument("--profile", action="store_true", help="profile our step instead (top ops by time)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument(
        "--no-huge-pages", action="store_true",
        help="leave glibc's malloc as it is (by default both sides run with the setting `python -m olmo_eqx` uses on CPU)",
    )
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not args.no_huge_pages:
        # The project's CPU runs re-execute with glibc.malloc.hugetlb=1 (olmo_eqx.run.huge_pages);
        # so does this script, and both sides' processes inherit it.
        from olmo_eqx.run.huge_pages import reexec_with_huge_pages

        reexec_with_huge_pages()
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r} (both sides)", flush=True)
    profile(args) if args.profile else compare(args)


if __name__ == "__main__":
    sys.exit(main())
