"""The CPU peak behind MFU: measured once on idle cores and cached; on busy cores it is an
underestimate (MFU would read high), so it serves that run only and is said as such."""

import json

import pytest

import olmo_eqx.train.mfu as mfu


@pytest.fixture
def fresh_peak(monkeypatch, tmp_path):
    monkeypatch.setenv("OLMO_EQX_CACHE", str(tmp_path))
    monkeypatch.setattr(mfu, "_CPU_PEAK", None)
    monkeypatch.setattr(mfu, "_CPU_PEAK_SOURCE", "")
    monkeypatch.setattr(mfu, "measure_cpu_peak", lambda: 3.0e11)
    monkeypatch.setattr(mfu.os, "cpu_count", lambda: 2)
    return tmp_path / "cpu_peak.json"


def test_a_peak_measured_on_idle_cores_is_cached(fresh_peak, monkeypatch):
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert mfu.cpu_peak_flops() == 3.0e11
    assert json.loads(fresh_peak.read_text())["flops_per_second"] == 3.0e11
    assert mfu.cpu_peak_source().startswith("measured now, cached")


def test_a_peak_measured_on_busy_cores_is_not_cached_and_says_so(fresh_peak, monkeypatch):
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (7.5, 6.0, 5.0))
    assert mfu.cpu_peak_flops() == 3.0e11
    assert not fresh_peak.exists()
    assert "busy cores (load 7.5 on 2)" in mfu.cpu_peak_source() and "MFU reads high" in mfu.cpu_peak_source()


def test_the_suite_caches_its_peak_even_on_busy_cores(fresh_peak, monkeypatch):
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (7.5, 6.0, 5.0))
    assert mfu.cpu_peak_flops(cache_when_busy=True) == 3.0e11
    assert json.loads(fresh_peak.read_text())["flops_per_second"] == 3.0e11
