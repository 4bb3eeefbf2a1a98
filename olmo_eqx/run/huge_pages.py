"""Transparent huge pages for XLA:CPU's per-step buffers: a start-up setting of CPU runs.

XLA:CPU allocates the temporaries of every execution anew with malloc and frees them after it:
742 MB per train step of the 12.6M benchmark model. glibc serves a block that large with a
fresh memory mapping and unmaps it on free, so each step first-touches 742 MB of new pages:
about 185,000 page faults per step, a third of a core spent in the kernel. glibc's tunable
`glibc.malloc.hugetlb=1` makes malloc ask for transparent huge pages (madvise), so the same
memory faults in 2 MB pages (about 1,000 faults per step); the step gets about 13% faster
(docs/performance.md). PyTorch's side of `scripts/bench_train.py` hardly changes with it.

glibc reads tunables only when a process starts, so `python -m olmo_eqx` re-executes itself
(same pid, same arguments) with the tunable added, from the top of the package's `__init__`,
before JAX is imported, when all of these hold (`why_not` names the first that fails): Linux
with glibc, the kernel's THP mode is `madvise` (with `always` every mapping gets huge pages
anyway; with `never` none can), JAX will run on the CPU only (`JAX_PLATFORMS=cpu`, which the
package sets on a machine without an accelerator device (olmo_eqx.run.accelerators), or no accelerator
plugin installed), `GLIBC_TUNABLES` does not already choose `glibc.malloc.hugetlb`,
and `OLMO_EQX_HUGE_PAGES` is not `0`. A run's header says which malloc it has (`describe`). In a notebook or any process
of your own, set `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` before starting Python.
"""

import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "OLMO_EQX_HUGE_PAGES"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def cpu_only(environ=os.environ) -> bool:
    """Whether JAX will run on the CPU alone, decided without importing JAX."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return {p.strip() for p in platforms.split(",")} == {"cpu"}
    if importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("libtpu"):
        return False
    return importlib.util.find_spec("jax_plugins") is None


def why_not(environ=os.environ) -> str | None:
    """Why the setting does not apply to a process with this environment, or None when it does."""
    if "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES already sets it ({environ['GLIBC_TUNABLES']})"
    if environ.get(OPT_OUT, "1") == "0":
        return f"{OPT_OUT}=0"
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return "not Linux with glibc"
    try:
        mode = THP_MODE.read_text().strip()
    except OSError:
        return f"no {THP_MODE}"
    if "[madvise]" not in mode:
        return f"THP mode is not madvise ({mode})"
    if not cpu_only(environ):
        return "JAX may run on an accelerator"
    return None


def environment_with_huge_pages(environ=os.environ) -> dict | None:
    """The environment to re-execute with, or None when the setting does not apply here."""
    if why_not(environ) is not None:
        return None
    tunables = ":".join(t for t in (environ.get("GLIBC_TUNABLES", ""), TUNABLE) if t)
    return {**environ, "GLIBC_TUNABLES": tunables}


def describe() -> str:
    """One line for a run's header: whether this process runs with the setting, and if not, why."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables:
        return f"GLIBC_TUNABLES={tunables} (olmo_eqx.run.huge_pages)"
    reason = why_not() or "not started as `python -m olmo_eqx`"
    return f"glibc's default malloc, no huge-page tunable: {reason}"


def started_as_olmo_eqx_command() -> bool:
    """Whether this process is `python [options] -m olmo_eqx ...`, asked while the package is
    still being imported (Python sets sys.argv[0] to "-m" until the module is found)."""
    argv = sys.orig_argv
    return sys.argv[:1] == ["-m"] and any(a == "-m" and b == "olmo_eqx" for a, b in zip(argv, argv[1:]))


def reexec_with_huge_pages() -> None:
    """Replace this process by the same command with huge pages on, where that applies (the
    package calls it for `python -m olmo_eqx`; scripts that time CPU steps call it too)."""
    environ = environment_with_huge_pages()
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)
