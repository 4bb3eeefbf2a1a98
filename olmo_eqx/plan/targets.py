"""What a plan compiles for: fake CPU devices, or abstract TPU chips that libtpu compiles for
on this CPU host (nothing is allocated, no TPU is needed).

    cpu:8                      8 fake CPU devices (XLA:CPU; the default)
    tpu:v5p:4x4x8              a 128-chip v5p slice (topology names as in Cloud TPU's docs)
    tpu:v6e:16x16              a 256-chip v6e slice
    tpu:v5p:8x8x8:2            two 512-chip slices (multi-slice: with `mesh.slice=2`)
    gpu:h100:8                 8 H100s (one host); gpu:h200:16 two hosts of 8 H200s

A TPU target needs libtpu (`pip install -e '.[tpu]'`, which pins `jax[tpu]` to the tested jax),
a GPU target JAX's CUDA plugin (`pip install -e '.[gpu]'`); neither needs the chip.
Chip figures are the vendor's published ones (Cloud TPU docs: v5p, v5e, v6e, TPU7x pages),
per *device* as JAX sees them: a TPU7x chip shows as two devices (its two TensorCores), a v5p
chip as one (megacore).
"""

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

from olmo_eqx.run.accelerators import accelerator_present

GB, GIB = 1e9, float(1024**3)


@dataclass(frozen=True)
class Chip:
    """One accelerator chip's published peaks (dense bf16, HBM, interconnect)."""

    name: str
    peak_bf16_flops: float  # per chip, FLOP/s
    hbm_bytes: float  # per chip
    hbm_bandwidth: float  # per chip, bytes/s
    ici_bandwidth: float  # per chip, bidirectional, bytes/s
    devices_per_chip: int = 1
    # The side of its matrix units' systolic array (a TPU's MXU), where the docs give it: a
    # matmul whose inner dimension is narrower fills that fraction of it (`plan.estimate`).
    mxu_width: Optional[int] = None
    # Data-center network (between slices) per chip, bytes/s, where the docs give it.
    dcn_bandwidth: Optional[float] = None


# Cloud TPU docs (docs.cloud.google.com/tpu/docs/{v5e,v5p,v6e,tpu7x}); H100/H200 from NVIDIA's
# datasheets (SXM: 989.5 TFLOP/s dense bf16; NVLink 900 GB/s). MXU sides: 128 x 128 ("System
# architecture", for v5e and v5p), 256 x 256 (the v6e page); TPU7x's page gives none.
CHIPS = {
    # v5e: 16 GiB, of which a program gets 15.75 (a v5e's own `memory_stats()["bytes_limit"]`, and
    # XLA:TPU's "available HBM (15.75G)" when it refuses one), measured on the chip.
    "v5e": Chip("TPU v5e", 197e12, 15.75 * GIB, 819 * GB, 400 * GB, mxu_width=128),
    # v5p's DCN: "Data center network (DCN) bandwidth per chip (Gbps) | 50" on its page.
    "v5p": Chip("TPU v5p", 459e12, 95 * GIB, 2765 * GB, 1200 * GB, mxu_width=128, dcn_bandwidth=50e9 / 8),
    "v6e": Chip("TPU v6e", 918e12, 32 * GB, 1640 * GB, 800 * GB, mxu_width=256),
    "tpu7x": Chip("TPU7x (Ironwood)", 2307e12, 192 * GIB, 7380 * GB, 1200 * GB, devices_per_chip=2),
    "h100": Chip("H100 SXM", 989.5e12, 80 * GB, 3350 * GB, 900 * GB),
    "h200": Chip("H200 SXM", 989.5e12, 141 * GB, 4800 * GB, 900 * GB),
}


@dataclass(frozen=True)
class Target:
    """A parsed `plan.target`: which platform, which chip, which topology, how many devices."""

    spec: str
    platform: str  # "cpu", "tpu" or "gpu"
    chip: Optional[Chip]
    topology: str = ""
    slices: int = 1
    n_devices: int = 0  # cpu / gpu: the count asked for; tpu: known once the topology is built

    @property
    def per_device(self) -> Optional[Chip]:
        """The chip's figures divided over the devices JAX shows for it."""
        if self.chip is None:
            return None
        n, c = self.chip.devices_per_chip, self.chip
        return dataclasses.replace(
            c, peak_bf16_flops=c.peak_bf16_flops / n, hbm_bytes=c.hbm_bytes / n,
            hbm_bandwidth=c.hbm_bandwidth / n, ici_bandwidth=c.ici_bandwidth / n,
            dcn_bandwidth=c.dcn_bandwidth / n if c.dcn_bandwidth else None,
        )

    def describe(self) -> str:
        if self.platform == "cpu":
            return f"{self.n_devices} fake CPU devices (XLA:CPU)"
        if self.platform == "gpu":
            return f"{self.n_devices} x {self.chip.name} (compiled by XLA:GPU, no GPU needed)"
        slices = f" x {self.slices} slices" if self.slices > 1 else ""
        return f"{self.chip.name} {self.topology}{slices} (compiled by XLA:{self.platform.upper()}, no chip needed)"


def parse_target(spec: str) -> Target:
    """`cpu:N`, `tpu:<generation>:<topology>[:<slices>]` or `gpu:<h100|h200>:N`; errors name the fix."""
    parts = spec.split(":")
    kind = parts[0]
    usage = (
        f"plan.target={spec!r} is not a target; use cpu:N (fake CPU devices), tpu:GEN:TOPOLOGY[:SLICES] "
        f"(GEN one of {', '.join(k for k in CHIPS if not k.startswith('h'))}; e.g. tpu:v5p:4x4x8) or gpu:h100:N"
    )
    if kind == "cpu" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) > 0:
        return Target(spec, "cpu", None, n_devices=int(parts[1]))
    if kind == "tpu" and len(parts) in (3, 4):
        generation, topology = parts[1], parts[2]
        if generation not in CHIPS or generation.startswith("h"):
            raise SystemExit(usage)
        if not re.fullmatch(r"\d+(x\d+){1,2}", topology):
            raise SystemExit(f"plan.target={spec!r}: the topology {topology!r} must look like 4x4x8 (v5p, TPU7x) or 16x16 (v5e, v6e)")
        slices = int(parts[3]) if len(parts) == 4 and parts[3].isdigit() else (1 if len(parts) == 3 else 0)
        if slices < 1:
            raise SystemExit(f"plan.target={spec!r}: the number of slices must be a whole number >= 1")
        chips = math.prod(int(d) for d in topology.split("x"))
        n = chips * CHIPS[generation].devices_per_chip * slices
        return Target(spec, "tpu", CHIPS[generation], topology, slices, n)
    if kind == "gpu" and len(parts) == 3 and parts[1] in ("h100", "h200") and parts[2].isdigit():
        return Target(spec, "gpu", CHIPS[parts[1]], n_devices=int(parts[2]))
    raise SystemExit(usage)


def compile_on_this_host(target: Target) -> None:
    """Set JAX up to compile `target`'s programs on this host's CPU: fake CPU devices for a
    `cpu:N` target, set before JAX starts its CPU backend (the CUDA plugin of an accelerator
    target would otherwise look for a driver), and no persistent compilation cache for chips
    that are not here. Call it before anything starts a JAX backend."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if target.platform == "cpu":
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={target.n_devices}".strip()
    import jax

    # The package has imported jax already, which read JAX_PLATFORMS then; its backends
    # start only now, so the setting still takes effect through the config.
    jax.config.update("jax_platforms", "cpu")
    if target.platform != "cpu":
        # A program for abstract chips cannot be loaded back from a persistent compilation
        # cache (there is no client to load it into); a user's JAX_COMPILATION_CACHE_DIR
        # would only collect entries that warn on every later read.
        jax.config.update("jax_enable_compilation_cache", False)


def tpu_devices(target: Target) -> list:
    """Abstract TPU devices of `target`'s topology (libtpu compiles for them; none is allocated)."""
    from jax.experimental import topologies

    generation = next(k for k, c in CHIPS.items() if c is target.chip)
    # libtpu takes a lock file so that two processes never drive one TPU; compiling drives
    # none, and a second plan (or test run) beside this one must not be refused.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not accelerator_present():
        # Off a TPU VM libtpu asks the metadata server for the VM's worker hostnames, gets a
        # warning text back and prints a 5-line `E0000 ... unexpected worker hostname` block
        # before compiling fine; naming this host as the only worker keeps the plan's output
        # clean (the topology compiled for is the one named, whatever this says).
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    options = {"num_slices": target.slices} if target.slices > 1 else {}
    dims = [int(d) for d in target.topology.split("x")]
    if math.prod(dims) < 4:
        # A topology smaller than libtpu's default host (2x2x1, four chips), e.g. the one-chip
        # v5e (v5litepod-1): the host is the topology itself.
        options["chips_per_host_bounds"] = (dims + [1, 1])[:3]
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=f"{generation}:{target.topology}", **options)
    except Exception as e:  # libtpu missing, or a topology it does not know
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(
            f"plan.target={target.spec}: cannot build the TPU topology ({message}); install the TPU compiler "
            "with `pip install -e '.[tpu]'`, and check the topology against Cloud TPU's docs (v5p: 2x2x1, 4x4x8, ...; "
            "v6e: 2x2, 16x16, ...)"
        ) from None
    return list(topology.devices)


# XLA:GPU plans for a GPU it is told about: a GpuTargetConfigProto (text) with the figures
# CUDA's device query would report. Hopper SXM (sm_90): 132 SMs, 228 KiB shared memory per SM
# (227 KiB opt-in per block), 50 MiB L2, boost clock 1.98 GHz; NVIDIA's H100/H200 datasheets.
_HOPPER = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 * 1024,
    "shared_memory_per_core": 228 * 1024,
    "shared_memory_per_block_optin": 227 * 1024,
    "threads_per_core_limit": 2048,
    "core_count": 132,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2**31 - 1,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "l2_cache_size": 50 * 1024 * 1024,
    "clock_rate_ghz": 1.98,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}
# Device memory as CUDA reports it (a little under the marketing GB), and the product name.
_GPU_MEMORY = {"h100": (84_942_979_072, "NVIDIA H100 80GB HBM3"), "h200": (151_397_597_184, "NVIDIA H200 141GB HBM3e")}


def gpu_target_config(generation: str) -> str:
    """The text GpuTargetConfigProto XLA:GPU compiles for instead of querying a device."""
    memory, name = _GPU_MEMORY[generation]
    info = [f"  {key}: {value}" for key, value in _HOPPER.items()]
    info += [
        f"  memory_bandwidth: {int(CHIPS[generation].hbm_bandwidth)}",
        f"  device_memory_size: {memory}",
        "  cuda_compute_capability { major: 9 minor: 0 }",
        f'  name: "{name}"',
    ]
    return (
        "gpu_device_info {\n" + "\n".join(info) + "\n}\n"
        'platform_name: "CUDA"\n'
        "dnn_version_info { major: 9 minor: 8 patch: 0 }\n"
        f'device_description_str: "{name}"\n'
    )


def gpu_devices(target: Target) -> list:
    """Abstract NVIDIA GPUs (8 per host) that JAX's CUDA plugin compiles for without a GPU.

    The plugin's topology factory takes a target config instead of a device, and ptxas from
    the nvidia-cuda-nvcc wheel; JAX must run with `JAX_PLATFORMS=cpu`, else the plugin's
    start-up looks for a driver (cuInit) and unregisters itself.
    """
    from jax.experimental import topologies

    generation = next(k for k, c in CHIPS.items() if c is target.chip)
    per_host = min(8, target.n_devices)
    if target.n_devices % per_host:
        raise SystemExit(f"plan.target={target.spec}: a GPU count above 8 must be a multiple of 8 (whole hosts)")
    try:
        topology = topologies.get_topology_desc(
            platform="cuda",
            topology_name="",
            target_config=gpu_target_config(generation),
            topology=f"1x{target.n_devices // per_host}x{per_host}",
        )
    except Exception as e:  # the plugin missing, or unregistered
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(
            f"plan.target={target.spec}: cannot build the GPU topology ({message}); install JAX's CUDA "
            "plugin with `pip install -e '.[gpu]'` (no GPU or driver needed)"
        ) from None
    return list(topology.devices)
