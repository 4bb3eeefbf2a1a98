"""The CPU peak behind MFU: one figure per machine, measured once and cached, so that runs'
MFU compare; one measured on busy cores (an underestimate: MFU reads high) is said as such
until a run on idle cores measures it again."""

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
    assert mfu.cpu_peak_source() == f"measured now on idle cores; cached in {fresh_peak} for every later run here"


def _next_run(monkeypatch, measured: float):
    """A later process: nothing in memory, and a new measurement would give `measured`."""
    monkeypatch.setattr(mfu, "_CPU_PEAK", None)
    monkeypatch.setattr(mfu, "measure_cpu_peak", lambda: measured)


def test_a_peak_measured_on_busy_cores_serves_every_run_until_idle_cores_measure_it(fresh_peak, monkeypatch, capsys):
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (7.5, 6.0, 5.0))
    assert mfu.cpu_peak_flops() == 3.0e11
    assert "measuring this CPU's float32 matmul peak" in capsys.readouterr().err
    assert json.loads(fresh_peak.read_text())["busy"] == "load 7.5 on 2"
    assert "busy cores (load 7.5 on 2)" in mfu.cpu_peak_source() and "MFU reads high" in mfu.cpu_peak_source()
    assert f"cached in {fresh_peak}" in mfu.cpu_peak_source()
    # The next run on busy cores divides by the same figure (its MFU compares), said as busy.
    _next_run(monkeypatch, 1.0e11)
    assert mfu.cpu_peak_flops() == 3.0e11 and capsys.readouterr().err == ""
    assert "on busy cores (load 7.5 on 2)" in mfu.cpu_peak_source()
    # A run on idle cores measures once more and keeps that; later runs use it.
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (0.3, 0.5, 0.5))
    _next_run(monkeypatch, 4.0e11)
    assert mfu.cpu_peak_flops() == 4.0e11 and "busy cores" in capsys.readouterr().err
    assert "busy" not in json.loads(fresh_peak.read_text())
    _next_run(monkeypatch, 1.0e11)
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (7.5, 6.0, 5.0))
    assert mfu.cpu_peak_flops() == 4.0e11 and "on idle cores" in mfu.cpu_peak_source()


def test_another_machines_peak_is_measured_again(fresh_peak, monkeypatch):
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    fresh_peak.write_text(json.dumps({"flops_per_second": 9.0e11, "measured_at": 0, "machine": "elsewhere"}))
    assert mfu.cpu_peak_flops() == 3.0e11
    assert json.loads(fresh_peak.read_text())["machine"] == mfu._machine()


def test_a_peak_that_cannot_be_cached_says_so(fresh_peak, monkeypatch):
    monkeypatch.setattr(mfu.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    fresh_peak.mkdir()  # where the file should go: writing it fails
    assert mfu.cpu_peak_flops() == 3.0e11
    assert "not cached" in mfu.cpu_peak_source() and "the next run measures again" in mfu.cpu_peak_source()
