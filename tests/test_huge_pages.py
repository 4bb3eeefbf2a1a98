"""When CPU runs re-execute with glibc's huge-page tunable (olmo_eqx.huge_pages). That the command
really does, keeping its pid, is checked by test_pretrain's SIGTERM test, on hosts that allow it."""

import pytest

from olmo_eqx import huge_pages


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
