"""What XLA:CPU's compile of the suite's kind of train step costs under given XLA flags.

Compiling is most of the test suite's CPU time, so tests/clihelp.py (SUITE_XLA_FLAGS) picks
flags that compile cheaply. This compiles three train steps with the compilation cache off and
prints wall and CPU seconds; compare flag sets one after another on idle cores:

    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" \
        python scripts/bench_suite_compile.py
    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 \
        --xla_cpu_use_fusion_emitters=false" python scripts/bench_suite_compile.py
    XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 \
        --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1" \
        python scripts/bench_suite_compile.py
"""

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from olmo_eqx.config import compose_config  # noqa: E402
from olmo_eqx.plan import compile_train_step  # noqa: E402

CASES = [
    ("olmo3_nano, 1 device", ["model=olmo3_nano", "data.sequence_length=64", "data.global_batch_size=8"], 1),
    ("olmo3_tiny, 8 devices", ["model=olmo3_tiny", "data.sequence_length=128", "data.global_batch_size=8"], 8),
    ("olmo_hybrid_tiny, 8 devices", ["model=olmo_hybrid_tiny", "data.sequence_length=64", "data.global_batch_size=8"], 8),
]


def main() -> None:
    jax.config.update("jax_enable_compilation_cache", False)
    if len(jax.devices()) < max(n for *_, n in CASES):
        raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (see the docstring)")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    wall, cpu = 0.0, 0.0
    for name, overrides, devices in CASES:
        config = compose_config(overrides)
        start, start_cpu = time.perf_counter(), time.process_time()
        compile_train_step(config, jax.devices()[:devices])
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        wall, cpu = wall + seconds, cpu + cpu_seconds
        print(f"{name:30s} trace + lower + compile {seconds:6.2f} s wall, {cpu_seconds:6.2f} s CPU", flush=True)
    print(f"{'total':30s} {wall:6.2f} s wall, {cpu:6.2f} s CPU")


if __name__ == "__main__":
    main()
