"""When CPU runs re-execute with glibc's huge-page tunable (olmo_eqx.run.huge_pages). That the command
really does, keeping its pid, is checked by test_pretrain's SIGTERM test, on hosts that allow it."""

import pytest

from olmo_eqx.run import huge_pages


@pytest.fixture
def thp_madvise(monkeypatch, tmp_path):
    """A Linux/glibc host whose THP mode is `madvise` (the kernel file replaced by a copy)."""
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    monkeypatch.setattr(huge_pages.platform, "libc_ver", lambda: ("glibc", "2.36"))
    return mode


def test_applies_on_a_cpu_run_and_keeps_other_tunables(thp_madvise):
    environ = huge_pages.environment_with_huge_pages({"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert environ["JAX_PLATFORMS"] == "cpu"


@pytest.mark.parametrize(
    "environ",
    [
        {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},  # the user's choice wins
        {"JAX_PLATFORMS": "cpu", "OLMO_EQX_HUGE_PAGES": "0"},  # opted out
        {"JAX_PLATFORMS": "cuda"},  # accelerators keep their process as it is
        {"JAX_PLATFORMS": "cpu,tpu"},
    ],
)
def test_does_not_apply(thp_madvise, environ):
    assert huge_pages.environment_with_huge_pages(environ) is None
    assert huge_pages.why_not(environ)  # and the run header can say why


@pytest.mark.parametrize("mode", ["[always] madvise never\n", "always madvise [never]\n"])
def test_only_in_thp_madvise_mode(thp_madvise, mode):
    thp_madvise.write_text(mode)
    assert huge_pages.environment_with_huge_pages({"JAX_PLATFORMS": "cpu"}) is None
    assert huge_pages.why_not({"JAX_PLATFORMS": "cpu"}) == f"THP mode is not madvise ({mode.strip()})"


def test_an_installed_accelerator_plugin_means_not_cpu_only(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(huge_pages.importlib.metadata, "entry_points", lambda group: ["jax_cuda12_plugin"])
    assert not huge_pages.cpu_only()


def test_a_plain_import_never_reexecutes():
    assert not huge_pages.started_as_olmo_eqx_command()  # pytest, not `python -m olmo_eqx`


def test_no_accelerator_device_means_jax_on_the_cpu(tmp_path):
    from olmo_eqx.run.accelerators import accelerator_present, run_on_cpu_without_an_accelerator

    pci = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
    pci.mkdir(parents=True)
    (pci / "vendor").write_text("0x1af4\n")  # a virtio device: no accelerator
    environ = {}
    assert not accelerator_present(str(tmp_path))
    assert run_on_cpu_without_an_accelerator(environ, str(tmp_path)) and environ == {"JAX_PLATFORMS": "cpu"}
    assert huge_pages.cpu_only(environ)  # so a CPU run keeps its huge pages, libtpu or not
    # The user's choice stays; a TPU on the PCI bus or a GPU's device file leaves JAX to choose.
    environ = {"JAX_PLATFORMS": "tpu"}
    assert not run_on_cpu_without_an_accelerator(environ, str(tmp_path)) and environ == {"JAX_PLATFORMS": "tpu"}
    (pci / "vendor").write_text("0x1ae0\n")
    assert accelerator_present(str(tmp_path)) and not run_on_cpu_without_an_accelerator({}, str(tmp_path))
    (pci / "vendor").write_text("0x1af4\n")
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev/nvidiactl").touch()
    assert accelerator_present(str(tmp_path))


def test_an_installed_libtpu_says_nothing_on_a_machine_without_one():
    """The `tpu` extra installed, no accelerator here: importing the package and using JAX prints
    nothing of libtpu (its 5-line error block came from JAX loading it as a backend)."""
    import importlib.util
    import os
    import subprocess
    import sys

    from olmo_eqx.run.accelerators import accelerator_present

    if importlib.util.find_spec("libtpu") is None or accelerator_present():
        pytest.skip("needs libtpu installed on a machine without an accelerator")
    environ = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    script = "import olmo_eqx, jax, os; print(jax.devices()[0].platform, os.environ['JAX_PLATFORMS'])"
    result = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "cpu"] and result.stderr == "", result.stderr
