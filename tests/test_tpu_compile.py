"""The accelerator paths, compiled (never run) by XLA:TPU on this CPU machine.

libtpu (the `tpu` extra, in the test extras) compiles for abstract TPU chips that
`jax.experimental.topologies` describes; nothing is allocated and no TPU is needed. These fail
when a change breaks the TPU lowering: the splash kernel under FSDP, tensor and context
parallelism, document masking, the eval and generation steps, and the planner's figures.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from olmo_eqx.config import compose_config
from olmo_eqx.plan import compile_train_step, estimate_step, plan_config
from olmo_eqx.plan.compile import COUNTS_ONLY_EFFORT, once_per_step_cost
from olmo_eqx.train.loss import unrolled_loss_chunks
from olmo_eqx.sharding import MeshConfig, ShardingRules, batch_sharding, make_mesh, sharded_abstract_model
from olmo_eqx.plan.targets import Chip, parse_target, tpu_devices

# One attention cycle of a tiny OLMo 3 (3 sliding + 1 full layer), bf16 compute.
# One micro-batch, fixed: these tests compile given layouts (auto would try more where one is refused).
TINY = ["model=olmo3_tiny", "model.compute_dtype=bfloat16", "data.sequence_length=256", "data.global_batch_size=8",
        "trainer.micro_batches=1"]
TARGET = parse_target("tpu:v5p:2x2x1")


@pytest.fixture(scope="module")
def chips() -> list:
    return tpu_devices(TARGET)


@pytest.fixture(autouse=True, scope="module")
def no_persistent_cache():
    """A program compiled for abstract chips cannot be read back from JAX's persistent cache
    (it has no client to load into): keep these compiles out of the suite's cache."""
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)


@pytest.fixture(autouse=True)
def default_precision():
    """The suite asks for float32 matmuls everywhere (parity with PyTorch); Mosaic refuses
    that precision for the bf16 operands a TPU run gives splash, as a real run never asks."""
    with jax.default_matmul_precision("default"):
        yield


def _splash_calls(hlo: str) -> int:
    """Mosaic (Pallas TPU) kernels in the compiled program: splash's forward and backward."""
    return hlo.count('custom_call_target="tpu_custom_call"')


def test_train_step_compiles_for_tpu_with_splash_picked_by_the_target(chips, tmp_path, monkeypatch):
    import olmo_eqx.plan.estimate as estimate_module

    config = compose_config(TINY)
    assert config.model.attention_impl == "auto" and jax.default_backend() == "cpu"

    def no_more_compiles(*_):
        raise AssertionError("a program with no loops needs no more compiles for its estimate")

    monkeypatch.setattr(estimate_module, "compile_train_step", no_more_compiles)
    p = plan_config(config, TARGET, chips, estimate=True, hlo_path=str(tmp_path / "step.hlo"))
    # One micro-batch, 4 layers unrolled on a TPU, the loss in one chunk: no while loop, so
    # XLA's count is the step's and the estimate reads it as it is (plus the kernel's FLOPs).
    estimate = p["estimate"]
    assert estimate["estimate_unit"] == "step"
    assert estimate["flops"] == p["xla_flops_per_device_loops_once"] + estimate["kernel_flops"]
    # auto resolves by the chips compiled for, not by this CPU host.
    assert p["attention_kernel"] == "splash" and p["fits"] and p["devices"] == 4
    assert 0 < p["bytes"]["temporaries"] < p["hbm_per_device"]
    # XLA:TPU holds its temporaries against HBM (a v5e chip ran programs whose arguments +
    # temporaries exceeded it): the plan's verdict counts what the compiler counts.
    assert p["bytes"]["needed"] == p["bytes"]["temporaries"] < p["bytes"]["total"]
    assert p["collectives"]["all-gather"]["count"] > 0 and not p["collectives_lower_bound"]
    assert _splash_calls((tmp_path / "step.hlo").read_text()) >= 2  # forward and backward kernels


def test_tensor_and_context_parallel_steps_with_documents_compile_for_tpu(chips):
    config = compose_config([*TINY, "data.sequence_length=512", "data.document_masking=true",
                             "mesh.fsdp=1", "mesh.context=2", "mesh.tensor=2", "data.global_batch_size=4"])
    step = compile_train_step(config, chips)
    assert _splash_calls(step.hlo) >= 2
    assert step.memory.temp_size_in_bytes > 0
    # Context parallelism all-gathers K/V over the context axis: the gathered K is [b, seq, ...].
    assert "all-gather" in step.hlo


def test_eval_and_generation_steps_compile_for_tpu(chips):
    from olmo_eqx.interop.generate import _generate
    from olmo_eqx.sharding import activation_sharding
    from olmo_eqx.train.step import make_eval_step

    config = compose_config(TINY)
    mesh, rules = make_mesh(MeshConfig(), chips), ShardingRules()
    model = sharded_abstract_model(config.model, mesh, rules)
    arrays, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    rows = batch_sharding(mesh, rules)
    tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((8, 256), jnp.float32, sharding=rows)
    eval_step = make_eval_step(mesh, rules)
    evaluate = jax.jit(lambda arrays, t, m: eval_step(eqx.combine(arrays, static), {"input_ids": t, "loss_mask": m}))
    assert _splash_calls(evaluate.lower(arrays, tokens, mask).compile().as_text()) >= 1

    start = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rules.batch)))
    constrain = activation_sharding(mesh, rules)

    def decode(arrays, tokens, start):
        model = eqx.combine(arrays, static)
        return _generate(model, tokens, start, jnp.array([0], jnp.int32), None, 8, (0.0, None, None), constrain)

    prompt = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=rows)
    compiled = jax.jit(decode).lower(arrays, prompt, start).compile()
    assert compiled.memory_analysis().temp_size_in_bytes > 0 and "while" in compiled.as_text()


def test_a_step_too_big_for_the_chip_is_refused_with_the_compilers_message():
    target = parse_target("tpu:v5e:2x2")
    # 512 sequences per 16 GB chip: the loss's float32 logits chunk alone is 8 GiB, twice.
    config = compose_config([*TINY, "data.global_batch_size=2048", "data.sequence_length=1024"])
    p = plan_config(config, target, tpu_devices(target), estimate=False)
    assert p["fits"] is False and "RESOURCE_EXHAUSTED" in p["refused"]


def test_the_estimate_counts_every_loop_iteration():
    """XLA counts a loop body once; the estimate's extrapolation from one and two unrolled
    cycles must equal XLA's count of the same step with no loops at all (3 cycles unrolled,
    one micro-batch, the loss's chunks unrolled), here on fake CPU devices where compiling is quick, and
    with full attention only (OLMo 2's block: a cycle is one layer)."""
    devices = jax.devices()[:4]
    looped = compose_config(["model=olmo3_tiny", "model.sliding_window=null", "model.n_layers=3", "+model.scan_layers=true",
                             "model.loss_chunk_size=32", "data.sequence_length=128",
                             "data.global_batch_size=8", "trainer.micro_batches=2"])
    flat = dataclasses.replace(
        looped,
        model=looped.model.replace(scan_layers=False),
        trainer=dataclasses.replace(looped.trainer, micro_batches=1),
    )
    chip = Chip("test", 1e12, 1e12, 1e12, 1e12)
    estimate = estimate_step(looped, devices, chip, collective_bytes=0.0, kernel="blockwise")
    with unrolled_loss_chunks():  # the same loss chunks, with no loop
        truth = compile_train_step(flat, devices).cost["flops"]
    counted_once = compile_train_step(looped, devices).cost["flops"]
    print(f"XLA FLOPs: loops counted once {counted_once:.4g}, no loops {truth:.4g}, extrapolated {estimate['flops']:.4g}")
    assert counted_once < 0.6 * truth  # what the estimate corrects
    assert abs(estimate["flops"] - truth) <= 0.01 * truth
    # The update runs once a step: counted per micro-batch (the one- and two-cycle programs
    # each hold it) the estimate would be further from the step's own count.
    once = once_per_step_cost(looped, devices)
    assert once["flops"] > 0 and once["gradient bytes"] > 0
    assert abs(estimate["flops"] - truth) < abs(estimate["flops"] + once["flops"] - truth)


def test_with_splash_the_estimate_extrapolates_from_one_and_two_layers(chips, monkeypatch):
    """Splash hides attention from XLA, so to XLA a sliding-window layer costs what a full one
    does: the estimate compiles one and two plain layers (not one and two 4-layer cycles), and
    still equals XLA's count of the whole step with no loops (a 4-layer cycle scanned, 2 micro-batches
    and 2 loss chunks against all unrolled), once the kernel's formula FLOPs are set aside.
    Its compiles ask for XLA's counts only (the lowest effort); the whole step's, at the
    compiler's default effort, has the same FLOPs."""
    import olmo_eqx.plan.estimate as estimate_module

    looped = compose_config([*TINY, "+model.scan_layers=true", "model.loss_chunk_size=128",
                             "trainer.micro_batches=2"])
    flat = dataclasses.replace(
        looped,
        model=looped.model.replace(scan_layers=False),
        trainer=dataclasses.replace(looped.trainer, micro_batches=1),
    )
    layers = []

    def compile_and_note(config, devices, *, effort=None):
        layers.append((config.model.n_layers, config.model.sliding_window, effort))
        return compile_train_step(config, devices, effort=effort)

    monkeypatch.setattr(estimate_module, "compile_train_step", compile_and_note)
    estimate = estimate_step(looped, chips, Chip("test", 1e12, 1e12, 1e12, 1e12), collective_bytes=0.0, kernel="splash")
    assert layers == [(1, None, COUNTS_ONLY_EFFORT), (2, None, COUNTS_ONLY_EFFORT)]
    with unrolled_loss_chunks():
        truth = compile_train_step(flat, chips).cost["flops"]
    assert abs(estimate["flops"] - estimate["kernel_flops"] - truth) <= 0.01 * truth
    assert estimate["estimate_unit"] == "layer"


def test_an_attention_kernel_runs_at_the_share_of_the_mxu_its_heads_fill():
    """Splash's FLOPs are counted at the share of a TPU's square matrix unit that head_dim
    fills (both its matmuls hold head_dim on one side): OLMo 3's 80-wide heads fill 80/128 of
    a v5e's, 80/256 of a v6e's; a chip whose array the docs do not give counts the peak."""
    from olmo_eqx.plan.estimate import kernel_mxu_fill

    model = compose_config(["model=olmo3_600m"]).model
    assert model.head_dim == 80
    assert kernel_mxu_fill(model, parse_target("tpu:v5e:1x1").per_device) == 80 / 128
    assert kernel_mxu_fill(model, parse_target("tpu:v6e:2x2").per_device) == 80 / 256
    assert kernel_mxu_fill(model.replace(head_dim=256), parse_target("tpu:v5e:1x1").per_device) == 1.0
    assert kernel_mxu_fill(model, Chip("test", 1e12, 1e12, 1e12, 1e12)) == 1.0


def test_the_estimate_counts_the_kernel_as_it_runs(monkeypatch):
    """Splash's share of the estimate, with XLA's counts stubbed (they are checked above):
    at the MXU share of OLMo 3's 80-wide heads on a v5e, its forward counted again under
    `full` remat, and where the backward is the separate dq kernel (at 8,192 tokens in
    1024-token blocks: the sliding-window layers, 60% of the count) that share counted with
    the two matmuls it repeats, 9/7 of the fused kernel's work (11/9 when the forward also
    runs twice). At 32,768 tokens the 600m's full layers count as fused: their heads run in
    two groups (splash.head_groups)."""
    from types import SimpleNamespace

    import olmo_eqx.plan.estimate as estimate_module
    from olmo_eqx.models import splash

    counts = {"flops": 1e12, "bytes accessed": 1e9, "optimal_seconds": 0.01}
    monkeypatch.setattr(estimate_module, "compile_train_step", lambda config, devices, effort=None: SimpleNamespace(cost=counts))
    monkeypatch.setattr(estimate_module, "once_per_step_cost",
                        lambda config, devices: {**dict.fromkeys(counts, 0.0), "gradient bytes": 0.0})
    chip = parse_target("tpu:v5e:1x1").per_device

    def kernel(remat: str, seq: int = 4096) -> dict:
        config = compose_config(["model=olmo3_600m", *f"model.remat={remat}".split(), f"data.sequence_length={seq}",
                                 f"data.global_batch_size={16 * 4096 // seq}", f"trainer.micro_batches={min(8, 16 * 4096 // seq)}"])
        return estimate_step(config, [None], chip, collective_bytes=0.0, kernel="splash")

    kept, recomputed = kernel("save_context"), kernel("full")
    assert recomputed["kernel_flops"] == pytest.approx(kept["kernel_flops"] * 16 / 12)
    # Each layer by its own policy: at 4,096 tokens the 4 full layers and the 12 sliding ones
    # (window 4,096) count alike, and only the sliding ones run their forward again.
    mixed = kernel("save_context model.remat_sliding=full")
    assert mixed["kernel_flops"] == pytest.approx(kept["kernel_flops"] * 4 / 16 + recomputed["kernel_flops"] * 12 / 16)
    assert kept["kernel_seconds"] == pytest.approx(kept["kernel_flops"] / (chip.peak_bf16_flops * 80 / 128))
    long_kept, long_recomputed = kernel("save_context", 8192), kernel("full", 8192)
    # At 32,768 tokens the full layers (4 x 32,768 of the count's 4 x 32,768 + 12 x 4,096) fuse
    # only with their heads in two groups (splash.head_groups); without the groups they would
    # count the dq kernel's repeat as the sliding-window layers do.
    grouped = kernel("save_context", 32768)
    monkeypatch.setattr(splash, "head_groups", lambda *args, **kwargs: 1)
    full_share = 4 * 32768 / (4 * 32768 + 12 * 4096)
    assert kernel("save_context", 32768)["kernel_flops"] == pytest.approx(
        grouped["kernel_flops"] * (9 / 7) / (full_share + (1 - full_share) * 9 / 7)
    )
    monkeypatch.setattr(splash, "FUSED_BACKWARD_MAX_KEY_BLOCKS", 64)  # every layer fused
    assert long_kept["kernel_flops"] == pytest.approx(kernel("save_context", 8192)["kernel_flops"] * (1 + 0.6 * 2 / 7))
    assert long_recomputed["kernel_flops"] == pytest.approx(kernel("full", 8192)["kernel_flops"] * (1 + 0.6 * 2 / 9))


def test_a_refused_estimate_leaves_the_layout_without_one(monkeypatch):
    """A layout that fits can still have a counts-only program the compiler refuses (XLA:TPU
    plans those with less care): the row gets a warning and no estimate, and the search goes
    on, instead of the whole search ending in the refusal."""
    import olmo_eqx.plan.estimate as estimate_module
    from olmo_eqx.plan.compile import CompileRefused
    from olmo_eqx.plan.estimate import add_estimate, step_seconds

    def refused(*args, **kwargs):
        raise CompileRefused("RESOURCE_EXHAUSTED: Ran out of memory on HBM (26.76G of 15.75G)")

    monkeypatch.setattr(estimate_module, "estimate_step", refused)
    row = {"fits": True, "collectives": {}, "attention_kernel": "splash", "warnings": []}
    add_estimate(row, None, [], Chip("test", 1e12, 1e12, 1e12, 1e12))
    assert row["estimate"] is None and step_seconds(row) is None
    assert "26.76G" in row["warnings"][-1] and "no step-time estimate" in row["warnings"][-1]


def test_search_takes_the_fewest_micro_batches_that_fit_and_names_the_fastest(monkeypatch):
    """The search's choices, over the rows plan_config would give (memory, fit, step time):
    the fewest micro-batches that fit found by bisection, only those layouts estimated."""
    import olmo_eqx.plan as plan_module
    import olmo_eqx.plan.layouts as layouts_module

    config = compose_config([*TINY, "data.global_batch_size=64", "data.sequence_length=2048"])  # 16 sequences per chip
    seconds = {"save_projections": 1.05, "offload_projections": 1.3, "save_attention": 1.0, "save_outputs": 1.03, "save_context": 1.02,
               "save_context/full": 1.01, "full": 1.4}  # save_context/full: the sliding layers' own policy full
    fewest = {"save_projections": 16, "offload_projections": 4, "save_attention": 2}  # the others fit with 1

    def fake_plan(layout, target, devices, *, estimate):
        assert not estimate  # probes compile the step only
        remat, micro = layout.model.remat, layout.trainer.micro_batches
        return {"remat": remat, "remat_sliding": layout.model.remat_sliding, "micro_batches": micro,
                "attention_block_size": layout.model.attention_block_size,
                "fits": micro >= fewest.get(remat, 1), "compile_seconds": 1.0, "bytes": {"total": 0, "needed": 0}}

    def name(row) -> str:
        return row["remat"] + (f"/{row['remat_sliding']}" if row["remat_sliding"] else "")

    def fake_estimate(row, layout, devices, chip):
        block = layout.model.attention_block_size or 1024  # splash's default block on a TPU
        step = seconds[name(row)] * (1 + 0.1 * row["micro_batches"]) * (0.95 if block == 512 else 1.0)
        row["estimate"] = {"xla_seconds": step, "roofline_seconds": step, "xla_mfu": 0.5, "roofline_mfu": 0.5}
        return row

    probed = []
    monkeypatch.setattr(layouts_module, "plan_config", lambda layout, *a, **k: probed.append(layout) or fake_plan(layout, *a, **k))
    monkeypatch.setattr(layouts_module, "add_estimate", fake_estimate)
    found = plan_module.search(config, TARGET, list(range(4)), report=lambda line: None)  # every policy, then two blocks
    shown = [(name(r), r["micro_batches"], r["attention_block_size"], "estimate" in r) for r in found["rows"]]
    # Bisection over 1, 2, 4, 8, 16: 4 first, then 16/8 or 2/1; refusals shown, unestimated.
    # (Probes that fit but are not the fewest are not shown: 4 micro-batches for save_attention.)
    assert shown[:12] == [
        ("save_projections", 4, None, False), ("save_projections", 8, None, False), ("save_projections", 16, None, True),
        ("offload_projections", 1, None, False), ("offload_projections", 2, None, False),
        ("offload_projections", 4, None, True),
        ("save_attention", 1, None, False), ("save_attention", 2, None, True), ("save_outputs", 1, None, True),
        ("save_context", 1, None, True), ("save_context/full", 1, None, True), ("full", 1, None, True),
    ]
    assert shown[12:] == [("save_context", 1, 2048, True), ("save_context", 1, 512, True)]
    assert len(probed) == 19  # 3 + 3 + 3 + 2 + 2 + 2 + 2 probes, then the two blocks: no layout compiled twice
    assert (found["best"]["remat"], found["best"]["attention_block_size"]) == ("save_context", 512)
    # The candidates to measure, fastest first by the estimate, and how they are printed.
    ranked = [(name(r), r["micro_batches"], r["attention_block_size"]) for r in found["ranked"]]
    assert ranked[:3] == [("save_context", 1, 512), ("save_context/full", 1, None), ("save_context", 1, None)]
    assert len(ranked) == 9  # every estimated layout that fits
    from olmo_eqx.plan.report import format_ranked

    printed = format_ranked(found["ranked"]).splitlines()
    assert printed[2:] == [
        "  1. model.remat=save_context trainer.micro_batches=1 model.attention_block_size=512   1.066 s (XLA)",
        "  2. model.remat=save_context model.remat_sliding=full trainer.micro_batches=1   1.111 s (XLA)",
        "  3. model.remat=save_context trainer.micro_batches=1   1.122 s (XLA)",
    ]
    from olmo_eqx.plan.report import format_row

    assert format_row(found["ranked"][1]).startswith("save_context, sliding full     1  auto")


def test_near_ties_go_to_the_layout_the_estimates_can_see():
    """Offloading to host ties with saving in HBM under both estimates (they see no host
    transfers), and splash's block sizes all tie (XLA cannot see into the kernel): the 7B at
    512 v5p chips gave 0.882 s for all three. The best is then the plain one."""
    from olmo_eqx.plan import _best

    def row(remat, block, step, total, host=0):
        return {"remat": remat, "attention_block_size": block, "fits": True,
                "bytes": {"needed": total, "host": host}, "estimate": {"xla_seconds": None, "roofline_seconds": step}}

    rows = [row("offload_projections", None, 0.8820, 16, host=22), row("save_projections", 1024, 0.8821, 40),
            row("save_projections", None, 0.8822, 40), row("full", None, 1.161, 8)]
    assert (_best(rows)["remat"], _best(rows)["attention_block_size"]) == ("save_projections", None)
    faster = [*rows, row("offload_projections", 256, 0.80, 16, host=22)]  # more than 1% faster: it wins
    assert _best(faster)["attention_block_size"] == 256


def test_building_a_tpu_topology_off_a_tpu_vm_prints_no_libtpu_error_block():
    """Off a TPU VM libtpu's start-up printed a 5-line `E0000 ... unexpected worker hostname`
    block before every TPU plan (it asks the VM's metadata server, which is not there);
    tpu_devices names this host as the only worker, and the topology is still the one asked for."""
    import os
    import subprocess
    import sys

    code = ("from olmo_eqx.plan.targets import parse_target, tpu_devices\n"
            "devices = tpu_devices(parse_target('tpu:v5p:4x4x8'))\n"
            "print(len(devices), len({d.process_index for d in devices}), devices[0].device_kind)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["128", "32", "TPU", "v5"]
    assert "unexpected worker hostname" not in done.stderr and "E0000" not in done.stderr, done.stderr


def test_a_refused_counts_only_program_is_counted_on_half_the_micro_batch(monkeypatch):
    """At long sequences the counts-only programs (their loss chunks unrolled) can need more
    than the step (190m, 2 x 32,768 tokens on a v5e: 29.8 GiB against the step's 9.0): the
    estimate then counts on half the micro-batch and doubles, taking the once-per-step part
    off once per extra part; a single sequence per device refused stays refused."""
    from types import SimpleNamespace

    import olmo_eqx.plan.estimate as estimate_module
    from olmo_eqx.plan.compile import CompileRefused

    compiled = []

    def compile_counts(config, devices, effort=None):
        compiled.append(config.data.global_batch_size)
        if config.data.global_batch_size > limit:
            raise CompileRefused("RESOURCE_EXHAUSTED: Ran out of memory on HBM (29.76G of 15.75G)")
        per_sequence = config.data.global_batch_size * config.model.n_layers
        return SimpleNamespace(cost={"flops": 1e12 * per_sequence, "bytes accessed": 1e9 * per_sequence,
                                     "optimal_seconds": 0.01 * per_sequence})

    once = {"flops": 1e11, "bytes accessed": 0.0, "optimal_seconds": 0.0, "gradient bytes": 0.0}
    monkeypatch.setattr(estimate_module, "compile_train_step", compile_counts)
    monkeypatch.setattr(estimate_module, "once_per_step_cost", lambda config, devices: once)
    chip = parse_target("tpu:v5e:1x1").per_device
    config = compose_config(["model=olmo3_190m", "data.sequence_length=32768", "data.global_batch_size=2",
                             "trainer.micro_batches=1", "mesh.fsdp=1"])
    devices = jax.devices()[:1]
    limit = 2
    whole = estimate_step(config, devices, chip, collective_bytes=0.0, kernel="splash")
    limit, compiled = 1, []
    halves = estimate_step(config, devices, chip, collective_bytes=0.0, kernel="splash")
    assert compiled == [2, 1, 1]  # refused whole, then one and two layers on one sequence
    assert halves["counted_on"] == "each micro-batch in 2 parts (a whole one was refused)" and whole["counted_on"] is None
    assert halves["flops"] == pytest.approx(whole["flops"] - once["flops"])
    limit = 0
    with pytest.raises(CompileRefused):
        estimate_step(config, devices, chip, collective_bytes=0.0, kernel="splash")


def test_loss_chunks_counted_in_their_loop_add_the_other_chunks(monkeypatch):
    """The last resort (one sequence refused too, the 600m at 32,768 tokens): XLA counts the
    loss loop's body once, so a compile with chunks twice as long gives one chunk's cost, added
    n - 1 times. On a v5e's 190m at 4 x 4096 the loop's count matched the unrolled one (FLOPs
    within 0.002%, XLA's time within 0.2%: docs/performance.md); here, with XLA's counts stubbed
    as one body plus the rest, it must give the unrolled total exactly."""
    from types import SimpleNamespace

    import olmo_eqx.plan.estimate as estimate_module

    def compile_counts(config, devices, effort=None):
        chunk, layers = config.model.loss_chunk_size, config.model.n_layers
        rest = 1e12 * layers
        return SimpleNamespace(cost={"flops": rest + 3e9 * chunk})  # the loop's body counted once

    monkeypatch.setattr(estimate_module, "compile_train_step", compile_counts)
    config = compose_config(["model=olmo3_600m", "data.sequence_length=32768", "data.global_batch_size=2",
                             "model.loss_chunk_size=1024", "trainer.micro_batches=1"])
    one, two = estimate_module._loss_loop_counted(config, [None], dict(sliding_window=None), 1)
    assert one["flops"] == pytest.approx(1e12 + 32 * 3e9 * 1024)  # 32 chunks of 1024 cover 32,767 targets
    assert two["flops"] - one["flops"] == pytest.approx(1e12)
