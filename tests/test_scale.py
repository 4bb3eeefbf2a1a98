"""Scale, shown by compiling the real train step (never running it) and reading XLA's figures.

Numeric equality of 8 devices and 1 says nothing about memory: these tests read the compiled
step's per-device temporaries and its HLO's collectives, as `python -m olmo_eqx.plan` does.
"""

import json
import subprocess
import sys

import pytest

import olmo_eqx.train.step as train_step_module
from olmo_eqx.models.base import unconstrained
from olmo_eqx.plan import collective_traffic, plan

# olmo3_tiny at a fixed per-device batch of 2 sequences of 128 tokens.
OVERRIDES = ["model=olmo3_tiny", "data.sequence_length=128"]


def plan_for(devices: int, *extra: str) -> dict:
    return plan([*OVERRIDES, f"data.global_batch_size={2 * devices}", *extra], devices)


@pytest.fixture(scope="module")
def plans() -> dict[int, dict]:
    return {n: plan_for(n) for n in (2, 8)}


def test_per_device_memory_stays_flat_as_devices_grow(plans):
    small, large = (plans[n]["bytes"]["temporaries"] for n in (2, 8))
    print(f"per-device temporaries: 2 devices {small / 2**20:.1f} MiB, 8 devices {large / 2**20:.1f} MiB")
    assert abs(large - small) <= 0.10 * small
    for p in plans.values():
        assert p["per_device_batch"] == 2 and p["warnings"] == []


def test_no_batch_sized_all_gathers_in_the_pure_fsdp_step(plans):
    for p in plans.values():
        assert p["batch_sized_all_gathers"] == 0
        # FSDP gathers weights: every all-gather is there, and the gradients are reduced.
        assert p["collectives"]["all-gather"]["count"] > 0
        assert p["collectives"]["all-reduce"]["count"] + p["collectives"]["reduce-scatter"]["count"] > 0


def test_the_checks_see_unpinned_activations(monkeypatch, plans):
    """Control: without the activation constraints (the old bug) the same checks fail."""
    monkeypatch.setattr(train_step_module, "activation_sharding", lambda mesh, rules: unconstrained)
    unpinned = plan_for(8)
    assert unpinned["batch_sized_all_gathers"] > 0
    assert unpinned["bytes"]["temporaries"] > 2 * plans[8]["bytes"]["temporaries"]


def test_tensor_parallel_layout_keeps_the_batch_split():
    p = plan_for(8, "mesh=fsdp_tp2")
    assert p["mesh"] == {"slice": 1, "data": 1, "fsdp": 4, "context": 1, "tensor": 2, "expert": 1} and p["batch_sized_all_gathers"] == 0
    assert any("computed on 2 devices" in w for w in p["warnings"])  # TP: each sequence on its tensor pair


def test_planner_command_at_32_devices(plans, tmp_path):
    out = tmp_path / "plan.json"
    command = [sys.executable, "-m", "olmo_eqx.plan", *OVERRIDES, "data.global_batch_size=64", "+plan.devices=32",
               f"+plan.json={out}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "olmo3_tiny" in result.stdout and "TPU v6e (32 GiB) yes" in result.stdout
    # Each compile says what it compiles and, when done, how long it took.
    assert "compile 1: 4 layers, remat none, 1 micro-batch(es) of 64 x 128 ..." in result.stdout
    assert "compile 1: done in " in result.stdout
    p = json.loads(out.read_text())
    assert p["devices"] == 32 and p["per_device_batch"] == 2
    eight = plans[8]["bytes"]["temporaries"]
    print(f"per-device temporaries: 8 devices {eight / 2**20:.1f} MiB, 32 devices {p['bytes']['temporaries'] / 2**20:.1f} MiB")
    assert abs(p["bytes"]["temporaries"] - eight) <= 0.10 * eight


def test_published_figures_show_beside_a_plan_of_their_model_only():
    from olmo_eqx.plan import format_estimate

    estimate = {"flops": 1e15, "reconciled_over_model_flops": 1.3, "kernel_flops": 0.0, "hbm_bytes": 1e12,
                "roofline_terms": {"compute": 1.0, "hbm": 0.5, "interconnect": 0.2}, "roofline_seconds": 1.0,
                "roofline_bound": "compute", "roofline_mfu": 0.5, "xla_seconds": 1.1, "xla_mfu": 0.45}
    assert "MaxText's OLMo 3 7B" in format_estimate({"model": "olmo3_7b", "estimate": estimate})
    shown = format_estimate({"model": "olmo3_190m", "estimate": estimate})
    assert "MaxText" not in shown and "(published:" not in shown and "roofline" in shown


def test_planner_refuses_unknown_options():
    result = subprocess.run([sys.executable, "-m", "olmo_eqx.plan", "+plan.device=4"], capture_output=True, text=True)
    assert result.returncode == 2 and "+plan.devices" in result.stderr and "+plan.target" in result.stderr
    result = subprocess.run([sys.executable, "-m", "olmo_eqx.plan", "+plan.max_layouts=x"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip() == "+plan.max_layouts must be a whole number, got 'x'"


HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %ag = f32[64]{0} all-gather(%x), dimensions={0}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %c = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %rs = f32[8]{0} reduce-scatter(f32[64]{0} %a), dimensions={0}
  ROOT %ar = f32[8]{0} all-reduce(%a), to_apply=%add
}
"""


def test_collectives_count_loop_iterations():
    traffic, gathered, unknown = collective_traffic(HLO)
    assert traffic["all-gather"] == {"count": 6, "bytes": 6 * 64 * 4}  # 6 trips of the loop body
    assert traffic["reduce-scatter"] == {"count": 1, "bytes": 64 * 4}  # the input it reduces
    assert traffic["all-reduce"] == {"count": 1, "bytes": 8 * 4}
    assert [g[:2] for g in gathered] == [("f32", (64,))] and not unknown


def test_a_refused_plan_says_refused_and_its_batch_line_has_no_empty_field():
    """A compile the target's compiler refused (README's preset on 128 v5p chips) printed
    `batch 512 x 8192 (, 1 micro-batch(es))` and `compiled in 6 s`."""
    from olmo_eqx.plan import format_plan

    p = {"model": "olmo3_7b", "parameters": 7, "target_description": "TPU v5p 4x4x8", "devices": 128,
         "global_batch": 512, "sequence_length": 8192, "micro_batches": 1, "compute_dtype": "bfloat16",
         "param_dtype": "float32", "remat": "none", "attention_impl": "auto", "attention_kernel": "splash",
         "attention_block_size": None, "loss_chunk_size": 1024, "compile_seconds": 6.0,
         "refused": "RESOURCE_EXHAUSTED: Ran out of memory on HBM"}
    lines = format_plan(p).splitlines()
    assert lines[1].startswith("batch 512 x 8192 (1 micro-batch(es)) | compute bfloat16")
    assert lines[2] == "refused in 6 s"
    with_share = format_plan({**p, "per_device_batch": 4.0})
    assert with_share.splitlines()[1].startswith("batch 512 x 8192 (4 per device, 1 micro-batch(es))")


def test_op_traffic_counts_each_op_once_per_loop_trip():
    """`op_traffic` (scripts/hlo_traffic.py): a fused op inside a 3-trip loop reads and writes
    its tensor 3 times; the fusion's insides and the loop's plumbing add nothing."""
    import jax
    import jax.numpy as jnp

    from olmo_eqx.plan.hlo import op_traffic

    x = jnp.ones((256, 512), jnp.float32)  # 512 KiB
    step = lambda i, x: jnp.exp(x) * 0.5 + 1.0  # noqa: E731
    hlo = jax.jit(lambda x: jax.lax.fori_loop(0, 3, step, x)).lower(x).compile().as_text()
    traffic, unknown = op_traffic(hlo)
    in_loop = [n for kind, n in traffic.items() if kind.endswith("| add") and n > 1024]  # not the counter
    assert in_loop == [3 * 2 * x.nbytes] and not unknown
    assert sum(traffic.values()) <= 3 * 2 * x.nbytes + 2 * x.nbytes + 64  # one copy in, the counter


def test_op_traffic_counts_a_prefetch_once_and_vmem_reads_not_at_all():
    """XLA:TPU prefetches a tensor into VMEM (layout memory space S(1)) with an asynchronous
    copy, which moves it once; the ops that then read it from VMEM cost no HBM bandwidth, so
    only their HBM-resident results count."""
    from olmo_eqx.plan.hlo import op_traffic

    hlo = """HloModule m

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %s = (f32[1024]{0:T(1024)S(1)}, f32[1024]{0}, u32[]{:S(2)}) copy-start(%a)
  %d = f32[1024]{0:T(1024)S(1)} copy-done(%s)
  %v = f32[1024]{0:T(1024)S(1)} custom-call(%d), custom_call_target="ConcatBitcast"
  ROOT %e = f32[1024]{0:T(1024)} exponential(%v), metadata={op_name="jit(f)/exp"}
}
"""
    traffic, _ = op_traffic(hlo)
    assert traffic == {"copy-done | ": 4096, "exponential | exp": 4096}


def _traffic_script(monkeypatch):
    import importlib.util
    import os
    from pathlib import Path

    # The script sets JAX_PLATFORMS and XLA_FLAGS for the JAX it starts: keep them to this test.
    for name in ("JAX_PLATFORMS", "XLA_FLAGS"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    path = Path(__file__).resolve().parents[1] / "scripts" / "hlo_traffic.py"
    spec = importlib.util.spec_from_file_location("hlo_traffic", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_traffic_script_refuses_a_bad_target_or_model_with_status_2(monkeypatch, capsys):
    script = _traffic_script(monkeypatch)
    assert script.main([*OVERRIDES, "--target", "tpu:v9:1x1"]) == 2
    assert "tpu:v9:1x1" in capsys.readouterr().err
    assert script.main(["model=olmo3_nope", "--target", "cpu:1"]) == 2
    assert "olmo3_nope" in capsys.readouterr().err


def test_the_traffic_script_compares_two_steps_kind_by_kind(monkeypatch, capsys):
    """scripts/hlo_traffic.py on the tiny model for one CPU device: the int8 step adds the
    quantization's round-and-convert passes, which the bf16 step does not have."""
    script = _traffic_script(monkeypatch)
    assert script.main([*OVERRIDES, "data.global_batch_size=2", "model.compute_dtype=bfloat16", "--target", "cpu:1",
                        "--change", "model.quantization=int8", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "change:" in out and "(model.quantization=int8)" in out
    rows = [line.split() for line in out.splitlines() if "round-nearest-even" in line]  # int8's rounding
    assert rows and all(float(row[1]) == 0.0 and float(row[2]) > 0 for row in rows)  # absent before, present after
