"""Checkpoints: bitwise resume, 8 -> 4 -> 1 device restore, half-written steps ignored,
SIGKILL during a save, mismatched model refused, retention, HF export."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_eqx.checkpoint import COMMIT_MARKER, CheckpointMismatchError, Checkpointer
from olmo_eqx.interop.export import export_hf
from olmo_eqx.checkpoint.digests import DIGEST_FILE
from olmo_eqx.data.sampler import LoaderState
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.sharding import MeshConfig, ShardingRules, batch_sharding, make_mesh
from olmo_eqx.train.optim import OptimConfig
from olmo_eqx.train.schedules import ScheduleConfig, make_schedule
from olmo_eqx.train.state import init_train_state, sharded_abstract_train_state
from olmo_eqx.train.step import make_train_step

from clihelp import xla_flags
from localcluster import launch_local_cluster

TINY = ModelConfig(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
    vocab_size=256, padded_vocab_size=256, sliding_window=16,
)
OPTIM = OptimConfig(lr=3e-3)
SCHEDULE = make_schedule(ScheduleConfig(name="cosine", warmup_steps=2), OPTIM.lr, 20)
K, N = 3, 3  # checkpoint after K steps, then N more
LOADER = LoaderState(seed=34521, epoch=0, step=K, instances_consumed=K * 16, fingerprint="test")


def batch_for(step: int, mesh):
    ids = jax.random.randint(jax.random.key(100 + step), (16, 32), 0, TINY.vocab_size, dtype=jnp.int32)
    sharding = batch_sharding(mesh)
    return {"input_ids": jax.device_put(ids, sharding), "loss_mask": jax.device_put(jnp.ones((16, 32)), sharding)}


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def mesh8():
    return make_mesh(MeshConfig())


@pytest.fixture(scope="module")
def reference(tmp_path_factory, mesh8):
    """An uninterrupted run of K + N steps that saved a checkpoint after step K on 8 devices."""
    directory = tmp_path_factory.mktemp("ckpt")
    step8 = make_train_step(OPTIM, SCHEDULE, mesh=mesh8)
    state = init_train_state(TINY, OPTIM, mesh8, ShardingRules(), jax.random.key(0))
    checkpointer = Checkpointer(directory, keep_last=3)
    losses = []
    for step in range(K + N):
        if step == K:
            # save() returns once the arrays are off the devices, so donating them next is safe.
            checkpointer.save(step, state, loader_state=LOADER, config={"optim": {"lr": OPTIM.lr}})
        state, metrics = step8(state, batch_for(step, mesh8))
        losses.append(np.asarray(metrics["loss"]))
    checkpointer.close()
    return {"dir": directory, "losses": losses, "final": host(state), "step8": step8}


def test_resume_is_bitwise(reference, mesh8):
    checkpointer = Checkpointer(reference["dir"])
    assert checkpointer.latest_step() == K
    restored = checkpointer.restore(target=sharded_abstract_train_state(TINY, OPTIM, mesh8))
    assert restored.step == K and int(restored.state.step) == K
    assert LoaderState.from_dict(restored.loader_state) == LOADER
    assert restored.config == {"optim": {"lr": OPTIM.lr}} and restored.model_config == TINY
    state = restored.state
    for step in range(K, K + N):
        state, metrics = reference["step8"](state, batch_for(step, mesh8))
        np.testing.assert_array_equal(np.asarray(metrics["loss"]), reference["losses"][step])
    for a, b in zip(jax.tree.leaves(host(state)), jax.tree.leaves(reference["final"])):
        np.testing.assert_array_equal(a, b)
    checkpointer.close()


@pytest.fixture(scope="module")
def one_device():
    """A 1-device mesh and its compiled train step, shared by the tests that restore onto it."""
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    return mesh, make_train_step(OPTIM, SCHEDULE, mesh=mesh)


@pytest.mark.parametrize("n_devices", [4, 1])
def test_restore_on_fewer_devices(reference, n_devices, one_device):
    if n_devices == 1:
        mesh, step = one_device
    else:
        mesh = make_mesh(MeshConfig(), jax.devices()[:n_devices])
        step = make_train_step(OPTIM, SCHEDULE, mesh=mesh)
    checkpointer = Checkpointer(reference["dir"])
    restored = checkpointer.restore(target=sharded_abstract_train_state(TINY, OPTIM, mesh))
    checkpointer.close()
    assert restored.state.model.lm_head.sharding.mesh.size == n_devices
    _, metrics = step(restored.state, batch_for(K, mesh))
    np.testing.assert_allclose(np.asarray(metrics["loss"]), reference["losses"][K], rtol=2e-6)


def test_half_written_steps_are_ignored(reference, tmp_path, mesh8):
    directory = tmp_path / "ckpt"
    shutil.copytree(reference["dir"], directory)
    # A step dir that never got its commit marker (copied, synced or written non-atomically) ...
    shutil.copytree(directory / str(K), directory / "7")
    (directory / "7" / COMMIT_MARKER).unlink()
    # ... and Orbax's own in-flight tmp dir of a save that was killed.
    shutil.copytree(directory / str(K), directory / "9.orbax-checkpoint-tmp-1234567")
    # A reader (eval, export) sees only the complete step and leaves a live run's tmp dir be.
    checkpointer = Checkpointer(directory, read_only=True)
    assert checkpointer.latest_step() == K and checkpointer.all_steps() == [K]
    with pytest.raises(FileNotFoundError, match="step 7"):
        checkpointer.restore(7, target=sharded_abstract_train_state(TINY, OPTIM, mesh8))
    assert checkpointer.restore(target=sharded_abstract_train_state(TINY, OPTIM, mesh8)).step == K
    with pytest.raises(PermissionError, match="read_only"):
        checkpointer.save(10, checkpointer.restore(target=sharded_abstract_train_state(TINY, OPTIM, mesh8)).state)
    checkpointer.close()
    assert (directory / "9.orbax-checkpoint-tmp-1234567").exists()
    # The writer sees the same.
    checkpointer = Checkpointer(directory)
    assert checkpointer.latest_step() == K
    checkpointer.close()


SIGKILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    from olmo_eqx.checkpoint import Checkpointer
    from olmo_eqx.models.config import ModelConfig
    from olmo_eqx.sharding import MeshConfig, ShardingRules, make_mesh
    from olmo_eqx.train.optim import OptimConfig
    from olmo_eqx.train.state import init_train_state

    # ~150 MB of state: far more than can reach the disk between save() returning and the kill.
    config = ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=64, mlp_hidden=1024,
                         vocab_size=16384, padded_vocab_size=16384, sliding_window=16)
    state = init_train_state(config, OptimConfig(), make_mesh(MeshConfig()), ShardingRules(), jax.random.key(0))
    checkpointer = Checkpointer(sys.argv[1])
    checkpointer.save(1, state)
    checkpointer.wait_until_finished()
    checkpointer.save(2, state)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_sigkill_during_save_resumes_from_previous(tmp_path):
    directory = tmp_path / "ckpt"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    result = subprocess.run(
        [sys.executable, "-c", SIGKILL_SCRIPT, str(directory)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert not (directory / "2" / COMMIT_MARKER).exists()
    # The kill really landed mid-save: Orbax's uncommitted tmp dir is what step 2 left.
    assert any("tmp" in p.name for p in directory.iterdir()), sorted(p.name for p in directory.iterdir())
    checkpointer = Checkpointer(directory)
    assert checkpointer.latest_step() == 1
    checkpointer.close()


def test_mismatched_model_config_is_refused(reference, mesh8):
    checkpointer = Checkpointer(reference["dir"])
    other = TINY.replace(n_layers=8, mlp_hidden=256)
    with pytest.raises(CheckpointMismatchError, match=r"n_layers: .* has 4, requested 8.*mlp_hidden"):
        checkpointer.restore(target=sharded_abstract_train_state(other, OPTIM, mesh8))
    # Settings that don't touch the weights (attention kernel, remat, compute dtype) may differ.
    runtime = TINY.replace(attention_impl="reference", remat="full")
    restored = checkpointer.restore(target=sharded_abstract_train_state(runtime, OPTIM, mesh8))
    assert restored.state.model.config == runtime
    checkpointer.close()


def test_retention_keeps_last_and_every(tmp_path, monkeypatch, mesh8):
    monkeypatch.chdir(tmp_path)
    checkpointer = Checkpointer("relative/ckpt", keep_last=2, keep_every=4, async_save=False)
    assert checkpointer.directory == tmp_path / "relative" / "ckpt"  # made absolute
    state = init_train_state(TINY, OPTIM, mesh8, ShardingRules(), jax.random.key(0))
    for step in range(1, 10):
        checkpointer.save(step, state)
    checkpointer.wait_until_finished()
    assert checkpointer.all_steps() == [4, 8, 9]
    assert checkpointer.save(9, state) is False  # an existing complete step is left alone
    checkpointer.close()


def test_retention_never_drops_the_last_verified_step_for_an_unverified_one(tmp_path, mesh8):
    state = init_train_state(TINY, OPTIM, mesh8, ShardingRules(), jax.random.key(0))
    checkpointer = Checkpointer(tmp_path, keep_last=2, async_save=False)
    checkpointer.save(1, state)
    checkpointer.save(2, state)
    # A newer step without a manifest (copied by hand, or saved by an older olmo_eqx) ...
    shutil.copytree(tmp_path / "2", tmp_path / "5")
    (tmp_path / "5" / DIGEST_FILE).unlink()
    checkpointer.save(3, state)
    # ... does not count towards keep_last: the two newest verified steps stay.
    assert checkpointer.all_steps() == [2, 3, 5]
    assert checkpointer.verify(3) and not checkpointer.verify(5)
    checkpointer.close()


def test_a_reader_of_a_live_run_pins_its_step_or_falls_back_saying_so(tmp_path, mesh8):
    """eval/compare/soup/export of a run still training: the step a reader reads is pinned, so
    the writer's retention keeps it; a step removed before the pin is replaced by the newest."""
    from olmo_eqx.checkpoint.paths import CheckpointLocation
    from olmo_eqx.checkpoint.pins import PIN_DIR, pin_location, pinned_steps, unpin
    from olmo_eqx.warm_start import locate

    run_dir = tmp_path / "run"
    state = init_train_state(TINY, OPTIM, mesh8, ShardingRules(), jax.random.key(0))
    writer = Checkpointer(run_dir / "checkpoints", keep_last=1, async_save=False)
    writer.save(1, state)
    writer.save(2, state)
    location = locate(run_dir)  # what +stage=eval checkpoint.load=<run dir> resolves and pins
    assert location.step == 2 and pinned_steps(run_dir / "checkpoints") == {2}
    writer.save(3, state)
    writer.save(4, state)
    assert writer.all_steps() == [2, 4]  # keep_last=1, and the pinned step
    # A pin whose process is gone is stale: removed, and retention goes on.
    (run_dir / "checkpoints" / PIN_DIR / "4.host.1").write_text('{"step": 3, "host": "%s", "pid": 999999999}' % os.uname().nodename)
    assert pinned_steps(run_dir / "checkpoints") == {2}
    # A step retention removed between the listing and the pin: the newest is read instead.
    gone = CheckpointLocation("olmo_eqx", run_dir / "checkpoints", 3)
    with pytest.warns(UserWarning, match="checkpoint step 3 in .* was removed .*; reading step 4, the newest"):
        fallback = pin_location(gone, lambda loc: (loc.directory / str(loc.step) / COMMIT_MARKER).exists(),
                                lambda: CheckpointLocation("olmo_eqx", run_dir / "checkpoints", 4))
    assert fallback.step == 4 and pinned_steps(run_dir / "checkpoints") == {2, 4}
    for pin in list((run_dir / "checkpoints" / PIN_DIR).iterdir()):
        unpin(pin)
    writer.save(5, state)
    assert writer.all_steps() == [5]  # unpinned: retention as usual
    writer.close()


def test_a_pin_written_during_retention_waits_for_it(tmp_path):
    """Retention reads the pins and renames its victims under the pins' lock: a reader pinning
    meanwhile waits, so its pin is either seen or written after the step is gone (and the
    reader's completeness check then falls back)."""
    import threading

    from olmo_eqx.checkpoint.pins import pin, pinned_steps, pins_locked, unpin

    directory = tmp_path / "checkpoints"
    directory.mkdir()
    pinned = []
    with pins_locked(directory):  # what Checkpointer._prune holds
        reader = threading.Thread(target=lambda: pinned.append(pin(directory, 7)))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive() and pinned_steps(directory) == set()
    reader.join(10)
    assert not reader.is_alive() and pinned_steps(directory) == {7}
    unpin(pinned[0])
    assert pinned_steps(directory) == set()


def test_retention_holds_the_pins_lock_where_no_reader_pinned_yet(tmp_path, mesh8, monkeypatch):
    """The first reader of a run creates pins/ while retention may be deleting: retention takes
    the lock (creating pins/) whenever it has a step to delete, so that pin too is seen or written
    after its step is gone; a run that never deletes keeps no pins/."""
    import fcntl

    import olmo_eqx.checkpoint.local_steps as checkpoint  # retention (`_prune`) looks pinned_steps up there
    from olmo_eqx.checkpoint.pins import PIN_DIR

    state = init_train_state(TINY, OPTIM, mesh8, ShardingRules(), jax.random.key(0))
    writer = Checkpointer(tmp_path, keep_last=1, async_save=False)
    writer.save(1, state)
    assert not (tmp_path / PIN_DIR).exists()
    held, read_pins = [], checkpoint.pinned_steps

    def probe(directory):  # is the lock held while retention reads the pins?
        with open(tmp_path / PIN_DIR / ".lock") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        return read_pins(directory)

    monkeypatch.setattr(checkpoint, "pinned_steps", probe)
    writer.save(2, state)
    assert held and all(held) and writer.all_steps() == [2]
    writer.close()


LIVE_WRITER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import jax
    from test_checkpoint import OPTIM, SCHEDULE, TINY
    from olmo_eqx.checkpoint import Checkpointer
    from olmo_eqx.sharding import MeshConfig, ShardingRules, make_mesh
    from olmo_eqx.train.state import init_train_state

    state = init_train_state(TINY, OPTIM, make_mesh(MeshConfig()), ShardingRules(), jax.random.key(0))
    directory = Path(sys.argv[1])
    step = 0
    with Checkpointer(directory, keep_last=1, async_save=False) as writer:
        while not (directory.parent / "stop").exists() and step < 1000:
            step += 1
            writer.save(step, state)
    print("SAVED", step, flush=True)
    """
)


def committed_steps(directory: Path) -> list[int]:
    return [int(p.parent.name) for p in directory.glob(f"*/{COMMIT_MARKER}") if p.parent.name.isdigit()] or [0]


def test_a_listing_that_loses_a_step_to_retention_is_taken_again():
    """Orbax reports a step dir removed while it lists as FileNotFoundError or, when the dir is
    gone before its metadata file is looked for, NotADirectoryError: both are listed again
    (the race below once failed CI on the second); a listing that keeps failing still raises."""
    from olmo_eqx.checkpoint.format import _listed

    for error in (FileNotFoundError, NotADirectoryError):
        calls = []

        def listing():
            calls.append(1)
            if len(calls) < 3:
                raise error("Path is not a directory: run/checkpoints/2")
            return [3]

        assert _listed(listing) == [3] and len(calls) == 3
    with pytest.raises(NotADirectoryError):
        _listed(lambda: (_ for _ in ()).throw(NotADirectoryError("gone")), attempts=2)


def test_an_eval_racing_a_live_runs_retention_never_fails(tmp_path, mesh8):
    """A writer process saves every step with keep_last=1 while this process, as +stage=eval
    does (`locate` pins, `load_model` verifies and restores), reads the run again and again:
    every read succeeds, its step is still there while pinned however far the writer got, and
    a step removed before its pin is replaced by the newest with a warning."""
    import time
    import warnings

    from olmo_eqx.checkpoint.pins import _release_all
    from olmo_eqx.warm_start import load_model, locate

    run_dir = tmp_path / "run"
    writer = subprocess.Popen(
        [sys.executable, "-c", LIVE_WRITER_SCRIPT, str(run_dir / "checkpoints"), str(Path(__file__).parent)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "XLA_FLAGS": xla_flags(1)},
    )
    try:
        deadline = time.time() + 120
        while not list((run_dir / "checkpoints").glob(f"*/{COMMIT_MARKER}")) and writer.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        expected = np.asarray(init_train_state(TINY, OPTIM, mesh8, ShardingRules(), jax.random.key(0)).model.embed)
        read = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(6):
                location = locate(run_dir)
                model = load_model(location, mesh8)
                np.testing.assert_array_equal(np.asarray(model.embed), expected)
                assert (location.directory / str(location.step) / COMMIT_MARKER).exists()  # kept while pinned
                read.append(location.step)
                _release_all()  # the reader's exit: retention may take the step now
        # The last pin may have been released after the writer's latest prune, which then kept
        # its step. Step L+1, not yet committed when L was the newest after the release, is
        # pruned after the release; L+2's save starts only once that prune returned.
        newest_after_release = max(committed_steps(run_dir / "checkpoints"))
        while max(committed_steps(run_dir / "checkpoints")) < newest_after_release + 2 and writer.poll() is None and time.time() < deadline + 120:
            time.sleep(0.05)
    finally:
        (run_dir / "stop").touch()
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err[-3000:]
    saved = int(out.split("SAVED")[1])
    # The writer saved on while the reads went on, so retention had the steps read to delete.
    assert len(set(read)) > 1 and saved > read[0] + 1, (read, saved)
    for warning in [w for w in caught if "was removed" in str(w.message)]:
        assert re.search(r"checkpoint step \d+ in .* was removed .*; reading step \d+, the newest", str(warning.message)), warning
    assert [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == [saved]  # nothing pinned now


def test_export_hf(reference, tmp_path):
    hf = pytest.importorskip("olmo_eqx.interop.hf")
    out = Path(export_hf(reference["dir"], tmp_path / "hf")["out"])
    assert (out / "config.json").exists()
    model = hf.load_hf(out, padded_vocab_size=TINY.padded_vocab_size)
    checkpointer = Checkpointer(reference["dir"])
    from olmo_eqx.models.registry import abstract_model

    saved = checkpointer.restore_model(target=abstract_model(TINY))
    checkpointer.close()
    np.testing.assert_array_equal(np.asarray(model.embed), np.asarray(saved.embed))
    np.testing.assert_array_equal(np.asarray(model.blocks.mlp.down_proj), np.asarray(saved.blocks.mlp.down_proj))


TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_default_matmul_precision", "highest")
    from olmo_eqx.infra.cluster import start_cluster
    from olmo_eqx.sharding import MeshConfig, ShardingRules, batch_sharding, make_mesh
    start_cluster()
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_checkpoint import LOADER, OPTIM, SCHEDULE, TINY, batch_for
    from olmo_eqx.checkpoint import Checkpointer
    from olmo_eqx.train.state import init_train_state
    from olmo_eqx.train.step import make_train_step

    mesh = make_mesh(MeshConfig())  # 2 processes x 2 devices
    single = make_mesh(MeshConfig(), jax.local_devices()[:1])

    def global_batch(step):
        host = {k: np.asarray(v) for k, v in batch_for(step, single).items()}
        sharding = batch_sharding(mesh)
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in host.items()}

    state = init_train_state(TINY, OPTIM, mesh, ShardingRules(), jax.random.key(0))
    step = make_train_step(OPTIM, SCHEDULE, mesh=mesh)
    for k in range(2):
        state, _ = step(state, global_batch(k))
    # Which files each process hashes, saving and restoring, is observed here.
    import json
    from pathlib import Path
    import olmo_eqx.checkpoint.digests as digests
    from olmo_eqx.train.state import sharded_abstract_train_state
    hashed, phase, digest = {"save": [], "restore": []}, ["save"], digests._digest
    def observed(path):
        hashed[phase[0]].append("/".join(Path(path).relative_to(sys.argv[1]).parts[1:]))
        return digest(path)
    digests._digest = observed

    checkpointer = Checkpointer(sys.argv[1])
    checkpointer.save(2, state, loader_state=LOADER)
    checkpointer.close()
    state, metrics = step(state, global_batch(2))
    print("LOSS", repr(float(metrics["loss"])), flush=True)

    phase[0] = "restore"
    reader = Checkpointer(sys.argv[1])
    reader.restore(2, target=sharded_abstract_train_state(TINY, OPTIM, mesh))
    reader.close()
    print("HASHED", json.dumps(hashed), flush=True)
    """
)


def test_two_process_checkpoint_restores_on_one_device(tmp_path, one_device):
    """Multi-controller run (2 processes x 2 CPU devices, gloo) -> checkpoint -> 1 device."""
    directory = tmp_path / "ckpt"
    procs = launch_local_cluster([sys.executable, "-c", TWO_PROCESS_SCRIPT, str(directory), str(Path(__file__).parent)])
    outputs = [p.communicate(timeout=300) for p in procs]
    losses = []
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-3000:]
        losses.append(float(next(line for line in out.splitlines() if line.startswith("LOSS")).split()[1]))
    assert losses[0] == losses[1]
    # Every file of the step hashed once when saved, by the process that wrote it, and
    # verified once when restored, each process taking a share.
    hashed = [json.loads(next(line for line in out.splitlines() if line.startswith("HASHED"))[7:]) for out, _ in outputs]
    manifest = json.loads((directory / "2" / DIGEST_FILE).read_text())["files"]
    from olmo_eqx.checkpoint.digests import _files

    assert set(manifest) == {p.relative_to(directory / "2").as_posix() for p in _files(directory / "2")}  # every file listed
    for phase in ("save", "restore"):
        mine = [set(h[phase]) for h in hashed]
        assert mine[0] and mine[1] and not mine[0] & mine[1], phase
        assert mine[0] | mine[1] == set(manifest) and sum(map(len, (h[phase] for h in hashed))) == len(manifest), phase
    assert all("ocdbt.process_1/" in name for name in hashed[1]["save"])

    mesh, step = one_device
    checkpointer = Checkpointer(directory)
    restored = checkpointer.restore(target=sharded_abstract_train_state(TINY, OPTIM, mesh))
    checkpointer.close()
    assert restored.step == 2 and LoaderState.from_dict(restored.loader_state) == LOADER
    _, metrics = step(restored.state, batch_for(2, mesh))
    np.testing.assert_allclose(float(metrics["loss"]), losses[0], rtol=2e-6)
