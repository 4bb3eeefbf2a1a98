"""Several slices: the mesh's outermost "slice" axis, data parallel across slices and FSDP inside
each, on the suite's 8 fake CPU devices as 2 slices x 4 (and one XLA:TPU multi-slice compile).

What a multi-slice run must keep: the same training as one slice of 8 (the slice axis only
replicates weights and splits the batch), checkpoints that move between the two layouts, and
nothing but the gradients' reduction crossing between slices (over DCN on a real pod), read
from the compiled program as the planner reads it (`olmo_eqx.plan.hlo.cross_slice_collectives`).
"""

import itertools
import math
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from olmo_eqx.checkpoint import Checkpointer
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.plan.hlo import cross_slice_collectives, cross_slice_summary, device_groups
from olmo_eqx.sharding import (
    MeshConfig, ShardingRules, batch_sharding, make_mesh, model_shardings, slice_of_devices, train_state_shardings,
)
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
from olmo_eqx.train.state import init_train_state, sharded_abstract_train_state
from olmo_eqx.train.step import make_train_step

# One loss chunk and one micro-batch: each gradient is then reduced once per step.
TINY = ModelConfig(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
    vocab_size=256, padded_vocab_size=256, sliding_window=16,
)
OPTIM = OptimConfig(lr=3e-3)
SCHEDULE = make_schedule(ScheduleConfig(name="cosine", warmup_steps=2), OPTIM.lr, 20)
BATCH, SEQ, STEPS = 16, 32, 4


def batch_for(step: int, mesh):
    ids = jax.random.randint(jax.random.key(100 + step), (BATCH, SEQ), 0, TINY.vocab_size, dtype=jnp.int32)
    mask = jnp.ones((BATCH, SEQ), jnp.float32).at[:3, :5].set(0.0)
    sharding = batch_sharding(mesh)
    return {"input_ids": jax.device_put(ids, sharding), "loss_mask": jax.device_put(mask, sharding)}


def host(tree):
    return jax.tree.map(np.asarray, eqx.filter(tree, eqx.is_array))


@pytest.fixture(scope="module")
def meshes():
    return {"1x8": make_mesh(MeshConfig()), "2x4": make_mesh(MeshConfig(slice=2))}


@pytest.fixture(scope="module")
def runs(meshes):
    """STEPS steps from the same init on each mesh: losses per step and the final state."""
    out = {}
    for name, mesh in meshes.items():
        step = make_train_step(OPTIM, SCHEDULE, mesh=mesh)
        state = init_train_state(TINY, OPTIM, mesh, ShardingRules(), jax.random.key(0))
        losses = []
        for i in range(STEPS):
            state, metrics = step(state, batch_for(i, mesh))
            losses.append(float(metrics["loss"]))
        out[name] = {"losses": losses, "state": state, "host": host(state)}
    return out


def test_the_slice_axis_is_outermost_and_splits_the_batch_only(meshes):
    mesh = meshes["2x4"]
    assert dict(mesh.shape) == {"slice": 2, "data": 1, "fsdp": 4, "context": 1, "tensor": 1, "expert": 1}
    # Off a multi-slice TPU the device list is split in order: devices 0-3 are slice 0.
    assert [d.id for d in mesh.devices[0].flat] == [d.id for d in jax.devices()[:4]]
    assert slice_of_devices(mesh) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch_sharding(mesh).spec[0] == ("slice", "data", "fsdp", "expert")
    state = sharded_abstract_train_state(TINY, OPTIM, mesh)
    specs = [s.spec for s in jax.tree.leaves(train_state_shardings(state, mesh, ShardingRules()))]
    assert all("slice" not in jax.tree.leaves(tuple(spec)) for spec in specs)  # weights and moments: replicated across slices
    assert model_shardings(state.model, mesh).embed.spec == jax.sharding.PartitionSpec(None, "fsdp")
    with pytest.raises(ValueError, match="splits the batch only"):
        ShardingRules(embed=("slice", "fsdp"))
    with pytest.raises(ValueError, match=r"^mesh: 8 devices do not split into slice=3 equal slices; set mesh.slice to a divisor of 8$"):
        make_mesh(MeshConfig(slice=3))


def test_a_slice_count_that_does_not_divide_the_devices_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "olmo_eqx", "+stage=pretrain", "mesh.slice=3", f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: mesh: 8 devices do not split into slice=3 equal slices; set mesh.slice to a divisor of 8" in done.stderr
    assert "Traceback" not in done.stderr


def test_two_slices_train_like_one_slice_of_eight(runs):
    one, two = runs["1x8"], runs["2x4"]
    print("losses 1x8", one["losses"], "\nlosses 2x4", two["losses"])
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=2e-6)
    for a, b in zip(jax.tree.leaves(two["host"]), jax.tree.leaves(one["host"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_checkpoint_moves_between_one_slice_and_two(runs, meshes, tmp_path):
    """Saved on 1 x 8, restored on 2 x 4, and back: the slice axis only replicates. A checkpoint
    of a mesh from before the slice axis (five axes) restores on 2 x 4 too."""
    for source, target in (("1x8", "2x4"), ("2x4", "1x8")):
        directory = tmp_path / f"{source}-to-{target}"
        with Checkpointer(directory) as checkpointer:
            checkpointer.save(STEPS, runs[source]["state"])
        with Checkpointer(directory) as checkpointer:
            restored = checkpointer.restore(target=sharded_abstract_train_state(TINY, OPTIM, meshes[target])).state
        assert restored.model.lm_head.sharding.mesh.shape["slice"] == meshes[target].shape["slice"]
        for a, b in zip(jax.tree.leaves(host(restored)), jax.tree.leaves(runs[source]["host"])):
            np.testing.assert_array_equal(a, b)

    old = Mesh(np.asarray(jax.devices()).reshape(1, 8, 1, 1, 1), ("data", "fsdp", "context", "tensor", "expert"))
    on_old = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(old, a.sharding.spec)) if isinstance(a, jax.Array) else a,
        runs["1x8"]["state"],
    )
    with Checkpointer(tmp_path / "five-axes") as checkpointer:
        checkpointer.save(STEPS, on_old)
    with Checkpointer(tmp_path / "five-axes") as checkpointer:
        restored = checkpointer.restore(target=sharded_abstract_train_state(TINY, OPTIM, meshes["2x4"])).state
    for a, b in zip(jax.tree.leaves(host(restored)), jax.tree.leaves(runs["1x8"]["host"])):
        np.testing.assert_array_equal(a, b)


def compiled_hlo(mesh, state) -> str:
    step = make_train_step(OPTIM, SCHEDULE, mesh=mesh)
    return eqx.filter_jit(step.step).lower(batch_for(0, mesh), state).compile().compiled.as_text()


def gradient_reductions(crossing: list[dict], state, mesh) -> str:
    """Why `crossing` is not the gradients' reduction alone, or "" when it is.

    A gradient crosses slices once per step (one micro-batch, one loss chunk), either whole
    or as its share inside a slice (after a reduce-scatter over FSDP): the elements reduced
    across slices must add up to one of those per parameter. A weight all-gather is another
    kind; an activation collective adds elements no parameter accounts for.
    """
    kinds = {c["kind"] for c in crossing}
    if not kinds <= {"all-reduce", "reduce-scatter"}:
        return f"collectives other than reductions cross slices: {sorted(kinds)}"
    if {dtype for c in crossing for dtype, _ in c["tensors"]} != {"f32"}:
        return "a reduction across slices that is not float32 (gradients are reduced in float32)"
    scalars = sum(c["runs"] for c in crossing for _, dims in c["tensors"] if not dims)
    if scalars > 8:  # the loss's sums and the token count, combined or not
        return f"{scalars} scalar reductions across slices"
    elements = sum(c["runs"] * math.prod(dims) for c in crossing for _, dims in c["tensors"] if dims)
    params = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    whole = [math.prod(p.shape) for p in params]
    shard = [math.prod(p.sharding.shard_shape(p.shape)) for p in params]
    choices = [(w,) if w == s else (w, s) for w, s in zip(whole, shard)]
    if not any(sum(pick) == elements for pick in itertools.product(*choices)):
        return (f"{elements:,} elements reduced across slices: not one gradient per parameter "
                f"(whole {sum(whole):,}, shares inside a slice {sum(shard):,})")
    return ""


def test_only_the_gradients_reduction_crosses_slices(runs, meshes, monkeypatch):
    mesh = meshes["2x4"]
    state = runs["2x4"]["state"]
    crossing = cross_slice_collectives(compiled_hlo(mesh, state), slice_of_devices(mesh))
    print("cross-slice per step:", cross_slice_summary(crossing))
    assert crossing and gradient_reductions(crossing, state, mesh) == ""
    # Control 1: one slice of 8 read as if devices 0-3 and 4-7 were two slices (FSDP across
    # slices, the layout the slice axis replaces): its weight all-gathers cross.
    one = meshes["1x8"]
    spanning = cross_slice_collectives(compiled_hlo(one, runs["1x8"]["state"]), [0, 0, 0, 0, 1, 1, 1, 1])
    assert "all-gather" in gradient_reductions(spanning, runs["1x8"]["state"], one)
    # Control 2: the embedding lookup as it was before the slice axis (pinned after the gather
    # only): GSPMD gathered the lookup's activations across slices, and the check sees it.
    import olmo_eqx.models.olmo3 as olmo3

    def one_step_lookup(table, tokens, dtype, constrain):
        return constrain(jnp.take(table, tokens, axis=0).astype(dtype), ("batch", "sequence", "act_embed"))

    monkeypatch.setattr(olmo3, "embed_tokens", one_step_lookup)
    unpinned = cross_slice_collectives(compiled_hlo(mesh, state), slice_of_devices(mesh))
    assert "all-gather" in gradient_reductions(unpinned, state, mesh)


def test_replica_groups_in_all_three_forms_and_megascale_transfers():
    """XLA writes device groups three ways; XLA:TPU sends what crosses slices to the DCN
    runtime as host transfers. Lines of the shape the compilers print (CPU 0.10.2, libtpu 0.0.42.1)."""
    assert device_groups("replica_groups={{0,4},{1,5}}, to_apply=%add", 8) == [[0, 4], [1, 5]]
    assert device_groups("replica_groups={}, to_apply=%add", 4) == [[0, 1, 2, 3]]
    assert device_groups("replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert device_groups("replica_groups=[2,4]<=[8], dimensions={0}", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    fsdp = "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}"
    assert device_groups(fsdp, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert device_groups("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global", 8) == [list(range(8))]
    assert device_groups("source_target_pairs={{0,1},{1,0}}, channel_id=3", 2) == [[0, 1], [1, 0]]
    with pytest.raises(ValueError, match="no replica groups"):
        device_groups("channel_id=3, dimensions={0}", 8)
    hlo = "\n".join([
        "HloModule jit_step, num_partitions=4",
        "ENTRY %main (p: f32[8,128]) -> f32[8,128] {",
        "  %all-reduce.1 = f32[8,128]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add",
        '  %send = (f32[8,128]{1,0}, u32[], token[]) send(%all-reduce.1, %after-all), channel_id=3, is_host_transfer=true, '
        'frontend_attributes={_xla_megascale_reduce_operation="SUM",_xla_megascale_transfer_type="ALL_REDUCE"}',
        "  ROOT %r = f32[8,128]{1,0} copy(%all-reduce.1)",
        "}",
    ])
    crossing = cross_slice_collectives(hlo, [0, 0, 0, 0, 1, 1, 1, 1])
    assert [(c["kind"], c["tensors"], c["bytes"]) for c in crossing] == [("all-reduce", [("f32", (8, 128))], 4096)]


def test_the_planner_plans_two_tpu_slices(tmp_path):
    """A multi-slice TPU target compiles by XLA:TPU (the topology with a slice count) on the
    hybrid mesh, and the plan says what crosses slices: gradients, about once each."""
    import json

    out = tmp_path / "plan.json"
    tiny = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16", "model.mlp_hidden=128",
            "model.vocab_size=256", "model.padded_vocab_size=256", "data.sequence_length=128", "data.global_batch_size=8"]
    command = [sys.executable, "-m", "olmo_eqx.plan", *tiny, "+plan.target=tpu:v5p:2x2x1:2", "+plan.estimate=false"]
    done = subprocess.run([*command, "mesh.slice=2", f"+plan.json={out}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cross-slice collectives per step (2 slices" in done.stdout and "only reductions cross slices" in done.stdout
    plan = json.loads(out.read_text())
    assert plan["mesh"] == {"slice": 2, "data": 1, "fsdp": 4, "context": 1, "tensor": 1, "expert": 1}
    x = plan["cross_slice"]
    assert set(x["by_kind"]) == {"all-reduce"} and x["dtypes"] == ["f32"]
    # Each device's share of every gradient, in TPU tiles (padding adds a little): no more
    # than its share of the whole model once, where a weight gathered over DCN would add its size.
    assert x["parameters_per_device"] <= x["tensor_elements"] <= 1.5 * x["parameters_per_device"], x


def test_devices_of_several_tpu_slices_need_the_slice_axis():
    """FSDP across slices is what the slice axis replaces: a mesh over two TPU slices' devices
    without it is refused, in one line that names the setting; with it, each slice's devices
    sit on their own row of the slice axis (the hybrid mesh of the slices' own tori)."""
    from olmo_eqx.plan.targets import parse_target, tpu_devices

    devices = tpu_devices(parse_target("tpu:v5p:2x2x1:2"))
    with pytest.raises(ValueError, match=r"^mesh: the 8 devices form 2 slices \(their slice_index\) but mesh.slice=1; set mesh.slice=2"):
        make_mesh(MeshConfig(), devices)
    mesh = make_mesh(MeshConfig(slice=2), devices)
    assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
