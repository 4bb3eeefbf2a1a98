"""Shared helpers of the CLI / stage / pretrain tests: run `python -m olmo_eqx` in a process of its own."""

import os
from pathlib import Path
from typing import Optional

from forked_command import run_command

# The suite's tiny programs take longer to compile than to run, and compiling is most of the
# suite's CPU time (a cold cache costs test_hybrid_parity + test_train_step + test_scale 160 s
# of CPU against 61 s warm). So XLA:CPU compiles them the cheap way: no LLVM optimisation passes
# (test_model_parity cold: 103 s -> 78 s) and XLA's older elemental emitters for fusions instead
# of the MLIR fusion emitters (those three files cold: 160 s -> 99 s of CPU), and its LLVM module
# compiled in one piece rather than split for parallel codegen threads (the cores are busy with
# the other worker anyway; scripts/bench_suite_compile.py: 9.0 -> 8.2 s of CPU). XLA's HLO passes
# are unchanged, and every parity bound still holds. Runs outside the suite keep XLA's defaults.
SUITE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test subprocess on `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {SUITE_XLA_FLAGS}"


# A seconds-scale pretrain run: the nano model, short sequences, a dozen steps.
TINY = [
    "+stage=pretrain",
    "model=olmo3_nano",
    "data.sequence_length=64",
    "data.global_batch_size=8",
    "trainer.steps=12",
    "trainer.log_every=2",
    "trainer.eval_every=6",
    "trainer.eval_batches=1",
    "schedule.warmup_steps=2",
    "checkpoint.every=6",
    # TensorBoard's writer imports torch when it is installed (2 s a run), and loss.png costs
    # matplotlib's import and drawing (0.8 s); test_pretrain's artifacts test covers both, and
    # the tests that look at loss.png ask for it (PLOT).
    "trainer.loggers=[jsonl]",
    "trainer.plot=false",
]
PLOT = "trainer.plot=true"


def olmo_eqx(
    *args: str,
    env: Optional[dict] = None,
    timeout: float = 300,
    cwd: Optional[Path] = None,
    cold: bool = False,
    file_size_limit: int = 0,
):
    """`python -m olmo_eqx ARGS` with the test environment, in a process of its own (forked from
    a warm interpreter unless `cold`: tests/forked_command.py); never raises.

    One CPU device unless `env` sets XLA_FLAGS (`xla_flags(n)`): a CLI test is about the
    command, not sharding, and a tiny run on one device costs 30% less CPU than on eight
    (6.8 against 9.5 CPU-s for TINY with a warm cache), a third of the suite's CPU being runs.
    With `file_size_limit`, no file it writes may grow past that many bytes (a full disk).
    """
    full_env = {**os.environ, "XLA_FLAGS": xla_flags(1), **(env or {})}
    return run_command(list(args), env=full_env, timeout=timeout, cwd=cwd, cold=cold, file_size_limit=file_size_limit)
