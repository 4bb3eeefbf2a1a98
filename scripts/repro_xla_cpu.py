"""Three XLA:CPU limits behind the CPU train step's speed, each in a few lines (docs/performance.md).

    python scripts/repro_xla_cpu.py
    taskset -c 0 python scripts/repro_xla_cpu.py      # one core

1. The weight gradient of a 3-D projection `[batch, seq, d] @ [d, f]` contracts over two
   axes; XLA:CPU's dot decomposer turns it into a transposed copy of the output gradient and
   a dot with a transposed left operand that neither YNNPACK nor Eigen's fast path takes. The
   same MLP over `[batch * seq, d]` has neither: its backward runs about 2x faster.
2. XLA:CPU's best float32 matmul (YNNPACK or Eigen) against PyTorch's (oneMKL) on the shapes of
   the benchmark model: the ceiling of any XLA:CPU train step relative to PyTorch's.
3. XLA:CPU mallocs each execution's temporaries anew; glibc maps a block that large freshly and
   unmaps it on free, so every call first-touches all of it again: one page fault per 4 KiB.
   The same function in a process started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (what
   `python -m olmo_eqx` does on CPU, olmo_eqx.run.huge_pages) faults 2 MiB pages instead.
"""

import os
import re
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

BATCH, SEQ, D, F = 8, 256, 256, 1024


def median_ms(run, repeats: int = 10) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def mlp_backward() -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (BATCH, SEQ, D))
    weights = tuple(jax.random.normal(k, shape) * 0.02 for k, shape in zip(keys[1:], [(D, F), (D, F), (F, D)]))

    def three_d(weights, x):
        gate, up, down = weights
        return jnp.sum((jax.nn.silu(x @ gate) * (x @ up)) @ down)

    def two_d(weights, x):
        return three_d(weights, x.reshape(BATCH * SEQ, D))

    print(f"1. SwiGLU MLP backward, x [{BATCH}, {SEQ}, {D}], hidden {F}, float32:")
    for name, loss in (("3-D [b, s, d] @ w", three_d), ("2-D [b*s, d] @ w", two_d)):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(weights, x).compile()
        hlo = compiled.as_text()
        copies = len(re.findall(r"%\w*copy\w*(?:\.\d+)? = ", hlo))
        transposed_dots = len(re.findall(r" dot\([^)]*\), lhs_contracting_dims=\{0\}, rhs_contracting_dims=\{1\}", hlo))
        ms = median_ms(lambda: jax.block_until_ready(compiled(weights, x)))
        print(f"   {name:20} {ms:7.1f} ms   copies in the HLO: {copies}, dots with both operands transposed: {transposed_dots}")


def matmul_ceiling() -> None:
    print("2. float32 matmul GFLOP/s, XLA:CPU (this jaxlib's default path) against PyTorch:")
    shapes = [((2048, 2048), (2048, 2048)), ((BATCH * SEQ, D), (D, F)), ((BATCH * SEQ, D), (D, 8192))]
    try:
        import torch
    except ImportError:
        torch = None
    for a_shape, b_shape in shapes:
        flops = 2 * a_shape[0] * a_shape[1] * b_shape[1]
        a, b = jnp.ones(a_shape, jnp.float32), jnp.ones(b_shape, jnp.float32)
        matmul = jax.jit(jnp.matmul)
        ours = flops / median_ms(lambda: jax.block_until_ready(matmul(a, b)), 20) / 1e6
        line = f"   {a_shape} @ {b_shape}: XLA {ours:5.0f}"
        if torch is not None:
            ta, tb = torch.ones(a_shape), torch.ones(b_shape)
            theirs = flops / median_ms(lambda: ta @ tb, 20) / 1e6
            line += f" | PyTorch {theirs:5.0f} | ratio {ours / theirs:.2f}"
        print(line)


def temporaries_per_call() -> None:
    """Time and page faults per call of a function with ~200 MB of temporaries (this process)."""
    x = jnp.ones((BATCH * SEQ, 8192), jnp.float32)

    def f(x):  # a log-softmax's forward and backward: several [2048, 8192] buffers at once
        return jax.grad(lambda x: jnp.sum(jax.nn.log_softmax(x * 1.5) * jnp.cos(x)))(x)

    compiled = jax.jit(f).lower(x).compile()
    jax.block_until_ready(compiled(x))
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ms = median_ms(lambda: jax.block_until_ready(compiled(x)), 20)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 21
    temp = compiled.memory_analysis().temp_size_in_bytes
    tunables = os.environ.get("GLIBC_TUNABLES") or "(none)"
    print(f"   GLIBC_TUNABLES={tunables}: temporaries {temp / 2**20:.0f} MiB, {faults:,.0f} page faults and {ms:.1f} ms per call")


def fresh_temporaries() -> None:
    print("3. a fresh temp buffer per call, with glibc's malloc as it comes and with huge pages:")
    for tunables in (None, "glibc.malloc.hugetlb=1"):
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        subprocess.run([sys.executable, __file__, "--temporaries"], env=env, check=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--temporaries"]:
        temporaries_per_call()
    else:
        mlp_backward()
        matmul_ceiling()
        fresh_temporaries()
