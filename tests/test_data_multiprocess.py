"""Two real processes (jax.distributed on localhost) read disjoint slices that make up the global batch.

The test runs this file as a script in two subprocesses; each initialises the JAX
multi-controller runtime, reads its rows with `DataLoader`, builds the global array with
`jax.make_array_from_process_local_data` and gathers it back with a collective.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from clihelp import xla_flags

SEQ, BATCH, STEPS, SEED = 8, 8, 3, 11


def _dataset(data_dir):
    from olmo_eqx.data.instances import InstanceDataset
    from olmo_eqx.data.mixes import source_from_paths

    return InstanceDataset([source_from_paths("synthetic", Path(data_dir) / "*.npy")], SEQ, 60000)


def worker(coordinator: str, process_id: int, data_dir: str, out_path: str) -> None:
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    from olmo_eqx.data.loader import DataLoader, global_batch_arrays

    if not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id)
    loader = DataLoader(_dataset(data_dir), BATCH, SEED, jax.process_index(), jax.process_count())
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    result = {"ids": [], "global_ok": []}
    for _ in range(STEPS):
        batch = loader.next_batch()
        arrays = global_batch_arrays(batch, sharding)
        gathered = np.asarray(multihost_utils.process_allgather(arrays["input_ids"], tiled=True))
        lo, hi = loader.rows
        result["ids"].append(batch.instance_ids.tolist())
        result["global_ok"].append(
            arrays["input_ids"].shape == (BATCH, SEQ) and np.array_equal(gathered[lo:hi], batch.input_ids)
        )
        result.setdefault("gathered", []).append(gathered.tolist())
    result["state"] = loader.state.to_dict()
    Path(out_path).write_text(json.dumps(result))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_real_processes_read_disjoint_slices_of_the_global_batch(tmp_path):
    from olmo_eqx.data.loader import DataLoader
    from test_data_support import make_token_files

    make_token_files(tmp_path, [100 * SEQ])
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_ADDOPTS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, coordinator, str(i), str(tmp_path), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=180)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(logs)
    results = [json.loads(out.read_text()) for out in outs]

    reference = DataLoader(_dataset(tmp_path), BATCH, SEED)
    for step in range(STEPS):
        slice0, slice1 = (np.array(r["ids"][step]) for r in results)
        assert not set(slice0) & set(slice1)  # disjoint
        np.testing.assert_array_equal(np.concatenate([slice0, slice1]), reference.sampler.global_batch(step))
        want = reference.next_batch().input_ids
        for r in results:
            assert r["global_ok"][step]
            np.testing.assert_array_equal(np.array(r["gathered"][step]), want)  # the global array is the global batch
    assert results[0]["state"] == results[1]["state"] == reference.state.to_dict()


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
