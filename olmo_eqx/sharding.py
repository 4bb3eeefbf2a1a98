"""Where every array lives: the device mesh, logical-axis rules, and the layout of a train state.

The model names each array dimension with a *logical* axis ("embed", "heads", ...; see
`olmo_eqx.models.base.logical_axes`). `ShardingRules` maps logical names to *mesh* axes
("data", "fsdp", "tensor"); the default is pure FSDP (OLMo 3's 7B layout): every weight split
along its model dimension over "fsdp", the batch split over ("data", "fsdp"). Tensor
parallelism is a config change: give "tensor" a size > 1 in `MeshConfig`.

Scale never changes code: a dimension that the mesh axis does not divide (a 64-wide model on
8 devices) is replicated instead of failing, so the same rules run a toy on a laptop and the
7B on a pod.

Several slices (TPU pods joined over the data-center network, DCN) get an outermost "slice"
axis: the batch is split over it first, and no weight or optimiser state is ever split over
it, so FSDP, tensor, context and expert parallelism stay inside a slice (on its ICI) and the
only traffic between slices is the gradients' reduction: MaxText's `dcn_data_parallelism`
beside its `ici_*` axes, OLMo-core's HSDP.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import equinox as eqx
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .models.config import ModelConfig
from .models.base import LogicalAxes, logical_axes, unconstrained
from .models.registry import abstract_model

MESH_AXES = ("slice", "data", "fsdp", "context", "tensor", "expert")
# The one mesh axis that crosses slices: only the batch may be split over it (ShardingRules).
SLICE_AXIS = "slice"


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes; exactly one may be -1, meaning "all remaining devices".

    `context` > 1 splits every sequence over that many devices (context parallelism, for long
    sequences): activations are sharded along the sequence and attention all-gathers K/V.

    `expert` > 1 is expert parallelism for a mixture of experts: each device holds
    n_experts / expert of every layer's experts, and tokens travel to their experts' devices
    and back by all-to-all. The expert axis is also a data-parallel axis (the batch is split
    over it) and the non-expert weights are FSDP-split over it too, so data x fsdp x expert
    devices hold one copy of the model. Dense models ignore it (it only splits the batch).

    `slice` > 1 splits the devices into that many slices (the outermost axis): data parallel
    across slices, every other axis inside one. On TPU devices of several slices (they carry a
    `slice_index`) it must equal the number of slices, and the mesh follows the hardware's
    slices; elsewhere (CPU, GPU, one TPU slice) the device list is split in order into equal
    groups, which stand for slices.
    """

    slice: int = 1
    data: int = 1
    fsdp: int = -1
    context: int = 1
    tensor: int = 1
    expert: int = 1

    def shape(self, n_devices: int) -> tuple[int, ...]:
        if self.slice < 1:
            raise ValueError(f"mesh: slice={self.slice} must be the number of slices, 1 or more")
        if n_devices % self.slice:
            raise ValueError(
                f"mesh: {n_devices} devices do not split into slice={self.slice} equal slices; "
                f"set mesh.slice to a divisor of {n_devices}"
            )
        sizes = [self.slice, self.data, self.fsdp, self.context, self.tensor, self.expert]
        described = " x ".join(f"{name}={size}" for name, size in zip(MESH_AXES, sizes))
        if sizes.count(-1) > 1:
            raise ValueError(f"mesh: at most one axis may be -1 (got {described})")
        known = math.prod(s for s in sizes if s != -1)
        if any(s == 0 or s < -1 for s in sizes) or n_devices % known:
            raise ValueError(
                f"mesh: {described} does not fit {n_devices} devices; "
                "choose sizes whose product divides the device count (use -1 for one axis to take the rest)"
            )
        sizes = [n_devices // known if s == -1 else s for s in sizes]
        if math.prod(sizes) != n_devices:
            resolved = " x ".join(f"{name}={size}" for name, size in zip(MESH_AXES, sizes))
            raise ValueError(
                f"mesh: {resolved} = {math.prod(sizes)} but there are {n_devices} devices; "
                "set one axis to -1 or make the product match"
            )
        return tuple(sizes)


def make_mesh(config: MeshConfig = MeshConfig(), devices: Optional[list] = None) -> Mesh:
    """A ("slice", "data", "fsdp", "context", "tensor", "expert") mesh over `devices` (default: every device).

    Axis types are *Auto* (GSPMD propagation): jax >= 0.10 defaults to Explicit, under which
    a matmul over a sharded contracting dimension fails without an explicit out_sharding.
    Devices of several TPU slices are laid out by slice (`create_hybrid_device_mesh`: each
    slice's devices in its torus order, the slices outermost); any other list is split in
    order, `mesh.slice` equal groups standing for slices.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = config.shape(len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    slices = physical_slices(devices)
    if slices > 1:
        return Mesh(_hybrid_grid(shape, slices, devices), MESH_AXES, axis_types=axis_types)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        # A TPU torus assigns each mesh axis a product of whole physical axes: fsdp 8 x expert 8
        # on a 4x4x4 slice needs one physical axis split in two, which jax does only when asked.
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=axis_types)


def physical_slices(devices: list) -> int:
    """How many slices `devices` come from: distinct `slice_index` values (multi-slice TPU), else 1."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def _hybrid_grid(shape: tuple[int, ...], slices: int, devices: list):
    """The device grid of a multi-slice mesh: the slice axis over DCN, every other inside a slice."""
    from jax.experimental import mesh_utils

    if shape[0] != slices:
        raise ValueError(
            f"mesh: the {len(devices)} devices form {slices} slices (their slice_index) but mesh.slice={shape[0]}; "
            f"set mesh.slice={slices}, so that FSDP and tensor parallelism stay inside a slice"
        )
    ici, dcn = (1, *shape[1:]), (slices,) + (1,) * (len(shape) - 1)
    try:
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
    except NotImplementedError:
        # As in make_mesh: a slice's torus may need one physical axis split between two mesh axes.
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)


def slice_of_devices(mesh: Mesh) -> list[int]:
    """The slice (position on the "slice" axis) of each of `mesh`'s devices, in the mesh's flat
    order: the order of a program's partitions when it is compiled for shardings on this mesh."""
    import numpy as np

    return np.indices(mesh.devices.shape)[MESH_AXES.index(SLICE_AXIS)].ravel().tolist()


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis (None = replicated). Defaults: pure FSDP."""

    # FSDP splits weights over "fsdp" and, when there is expert parallelism, over "expert" too
    # (the expert weights, already split by expert, then over "fsdp" alone: see spec_for).
    embed: Any = ("fsdp", "expert")
    heads: Optional[str] = "tensor"
    kv_heads: Optional[str] = "tensor"
    mlp: Optional[str] = "tensor"
    vocab: Optional[str] = "tensor"
    layers: Optional[str] = None
    norm: Optional[str] = None
    # A mixture of experts' expert dimension (olmoe.py): split over the "expert" mesh axis
    # (size 1 by default: then replicated, and the experts' weights shard along "embed" like any
    # FSDP weight).
    expert: Optional[str] = "expert"
    # OLMo-Hybrid's short convolution taps (tiny): replicated.
    conv: Optional[str] = None
    # Activations (pinned by the model through `ActivationSharding`). The batch is split over
    # every data-parallel axis, the slices first; the model dimension stays whole (FSDP gathers
    # weights, not activations); heads, MLP hidden and vocab follow tensor parallelism.
    batch: tuple[str, ...] = ("slice", "data", "fsdp", "expert")
    sequence: Optional[str] = "context"
    # The embedding lookup's rows before they are spread over every batch axis: the batch axes
    # the table is not split over (`models.base.embed_tokens`).
    lookup_batch: tuple[str, ...] = ("slice", "data")
    act_embed: Optional[str] = None
    act_heads: Optional[str] = "tensor"
    act_kv_heads: Optional[str] = "tensor"
    act_mlp: Optional[str] = "tensor"
    act_vocab: Optional[str] = "tensor"
    head_dim: Optional[str] = None
    # The sequence inside OLMo-Hybrid's delta-rule scan: whole on every device (the scan over
    # chunks has no context-parallel form; gathered once per layer, not once per chunk).
    gdn_sequence: Optional[str] = None

    def __post_init__(self):
        # Configs may hand over lists (YAML); keep the rules hashable (they key jit caches).
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
            value = getattr(self, f.name)
            for name in value if isinstance(value, tuple) else (value,):
                if name is not None and name not in MESH_AXES:
                    raise ValueError(f"sharding rule {f.name}={value!r}: mesh axes are {MESH_AXES} (or null)")
                # Weights replicated across slices, every other axis inside one: the only
                # traffic over DCN is then the gradients' reduction (and the loss's sums).
                if name == SLICE_AXIS and f.name not in ("batch", "lookup_batch"):
                    raise ValueError(
                        f"sharding rule {f.name}={value!r}: the {SLICE_AXIS!r} axis splits the batch only "
                        "(data parallel across slices); use it in `batch` and not here"
                    )

    def mesh_axes(self, logical: str) -> Any:
        if not hasattr(self, logical):
            raise ValueError(f"sharding rules have no entry for logical axis {logical!r}; add it to ShardingRules")
        value = getattr(self, logical)
        return tuple(value) if isinstance(value, (list, tuple)) else value


def _axis_size(mesh: Mesh, axes: Any) -> int:
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[n] for n in names)


def spec_for(axes: LogicalAxes, shape: tuple[int, ...], mesh: Mesh, rules: ShardingRules) -> P:
    """The PartitionSpec of one array from its logical axes.

    A mesh axis can shard one dimension only: one already used by an earlier dimension of the
    same array is dropped from a later dimension's axes (an expert weight [expert, embed, mlp]
    takes "expert" on its first dimension, so its "embed" keeps "fsdp" alone). A dimension is
    replicated when its remaining mesh axes don't divide it.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match array shape {shape}")
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape):
        mesh_axes = rules.mesh_axes(name)
        names = () if mesh_axes is None else (mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,))
        # Size-1 mesh axes shard nothing; leaving them out keeps printed layouts readable.
        names = tuple(n for n in names if mesh.shape[n] > 1 and n not in used)
        mesh_axes = names[0] if len(names) == 1 else (names or None)
        if not names or size % _axis_size(mesh, mesh_axes):
            spec.append(None)
            continue
        used.update(names)
        spec.append(mesh_axes)
    return P(*spec)


def model_shardings(model: eqx.Module, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> eqx.Module:
    """`NamedSharding` for every array of `model` (concrete or abstract), shaped like `model`."""
    axes = logical_axes(model)
    return jax.tree.map(
        lambda a, leaf: NamedSharding(mesh, spec_for(a, leaf.shape, mesh, rules)),
        axes,
        model,
        is_leaf=lambda x: isinstance(x, LogicalAxes),
    )


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """`abstract` (ShapeDtypeStruct leaves) with each leaf carrying its sharding: a restore target."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def sharded_abstract_model(config: ModelConfig, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> eqx.Module:
    """The model's structure laid out on `mesh`, allocating nothing: the target to restore weights onto."""
    abstract = abstract_model(config)
    return with_shardings(abstract, model_shardings(abstract, mesh, rules))


@dataclass(frozen=True)
class ActivationSharding:
    """The model's `constrain(x, axes)`: pins an activation to the layout the rules give it.

    Called inside the traced step, it needs no ambient mesh context (the mesh travels inside
    each `NamedSharding`). On a one-device mesh it is a no-op.
    """

    mesh: Mesh
    rules: ShardingRules = ShardingRules()

    def __call__(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        if self.mesh.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(x.shape, axes)))

    def spec(self, shape: tuple[int, ...], axes: tuple[str, ...]) -> P:
        """The PartitionSpec of an activation of `shape` with these logical axes."""
        return spec_for(LogicalAxes(axes), shape, self.mesh, self.rules)


def activation_sharding(mesh: Optional[Mesh], rules: ShardingRules = ShardingRules()):
    """`ActivationSharding(mesh, rules)`, or the model's no-op when there is no mesh."""
    return unconstrained if mesh is None else ActivationSharding(mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> NamedSharding:
    """Sharding of a global [batch, seq] input array: batch over ("slice", "data", "fsdp", "expert"), seq whole."""
    return NamedSharding(mesh, P(rules.mesh_axes("batch"), None))


def train_state_shardings(state: Any, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Any:
    """Shardings for a whole `TrainState` (concrete or abstract), shaped like it.

    Parameters follow the rules; every params-shaped subtree of the optimiser state (Adam's
    moments) takes its parameter's sharding; counters and statistics are replicated.
    """
    params = model_shardings(state.model, mesh, rules)
    params_def = jax.tree.structure(state.model)
    rep = replicated(mesh)

    def is_params(node) -> bool:
        return jax.tree.structure(node) == params_def

    return jax.tree.map(lambda node: params if is_params(node) else rep, state, is_leaf=is_params)

