"""Which platform JAX runs on, decided before JAX is imported.

JAX tries every backend whose plugin is installed, whether or not its hardware is there: with
libtpu installed (the `tpu` extra, which the test extras and the planner's TPU targets pull in)
on a machine without a TPU, its first backend call loads libtpu, which prints a 5-line error
block (`E0000 ... unexpected worker hostname ...`) before JAX falls back to the CPU. JAX's own
Cloud-TPU set-up (`jax._src.cloud_tpu_init`) looks for TPU chips on the PCI bus but still
lets the plugin load. So the package settles it first: on a machine with no accelerator device
and no `JAX_PLATFORMS` of the user's, it sets `JAX_PLATFORMS=cpu`, and no plugin is touched. A
CPU run then also keeps its huge pages (olmo_eqx.run.huge_pages, which needs JAX on the CPU alone).
The planner's TPU and GPU targets load their compilers directly (olmo_eqx.plan.targets), not as
backends, so they work the same.
"""

import glob
import os
from collections.abc import MutableMapping
from pathlib import Path

# PCI vendor of Google's TPU chips (the id JAX's hardware_utils looks for), and the device
# files of NVIDIA GPUs (bare metal, containers, WSL2), AMD GPUs (KFD) and TPU VMs' chips.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd", "/dev/accel0", "/dev/vfio/0")


def accelerator_present(root: str = "/") -> bool:
    """Whether this machine shows a TPU or GPU device (under `root`, for tests)."""
    if any(Path(root, f.lstrip("/")).exists() for f in _DEVICE_FILES):
        return True
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def run_on_cpu_without_an_accelerator(environ: MutableMapping[str, str] = os.environ, root: str = "/") -> bool:
    """Set `JAX_PLATFORMS=cpu` in `environ` when the user has not chosen a platform and the
    machine has no accelerator; whether it did. Effective only before JAX is imported (JAX
    reads the variable once), and inherited by the processes a run starts."""
    if environ.get("JAX_PLATFORMS", "").strip() or accelerator_present(root):
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True


def run_on_cpu_with_jax_imported_first(environ: MutableMapping[str, str] = os.environ, root: str = "/") -> bool:
    """`run_on_cpu_without_an_accelerator` for a user who imported JAX before the package
    (`import jax, olmo_eqx`): JAX has read `JAX_PLATFORMS` already, but it picks its backends
    only at its first call (`jax.devices()`, the first array), from its `jax_platforms`
    setting; until then that setting can still be made `cpu`. Whether it did: not once a
    backend is up, nor when the user chose a platform (the variable or the setting)."""
    import jax
    from jax._src import xla_bridge

    initialized = getattr(xla_bridge, "backends_are_initialized", lambda: bool(getattr(xla_bridge, "_backends", None)))
    if jax.config.jax_platforms or initialized():
        return False
    if not run_on_cpu_without_an_accelerator(environ, root):
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
