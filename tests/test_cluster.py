"""How a process finds its peers (olmo_eqx.infra.cluster): what each launcher's environment
makes of a process, then `python -m olmo_eqx` as real processes on 127.0.0.1 given exactly what
GKE gives each TPU pod and what a TPU VM pod host sees (its metadata server, a real one here),
and a host whose peer never arrives. No OLMO_EQX_DISTRIBUTED anywhere.

JAX's own TPU detectors insist on TPU chips, so on this CPU machine they never fire; the
processes here take the path a CPU host takes (the same figures, passed to
`jax.distributed.initialize` explicitly), the one a TPU host takes being JAX's detector
reading the same variables."""

import json
import os
import re
import sys
import time

import pytest

from olmo_eqx.infra.cluster import (
    Cluster,
    ClusterError,
    cluster_line,
    detect_cluster,
    metadata_endpoint,
    missing_peers_line,
    peer_timeout_s,
    running_on_tpu_vm,
    start_cluster,
)

from clihelp import TINY
from localcluster import launch_local_cluster, tpu_vm_metadata


def _jax_port() -> str:
    from jax._src.clusters import cloud_tpu_cluster

    return cloud_tpu_cluster.coordinator_port


GKE_TWO_HOSTS = {"TPU_WORKER_HOSTNAMES": "pod-0.job,pod-1.job", "TPU_WORKER_ID": "1", "TPU_SKIP_MDS_QUERY": "true"}
GKE_SLICES = {"TPU_WORKER_HOSTNAMES": "s1-0.job,s1-1.job", "TPU_WORKER_ID": "1", "MEGASCALE_NUM_SLICES": "2",
              "MEGASCALE_SLICE_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "s0-0.job"}


@pytest.mark.parametrize("env, expected", [
    ({}, Cluster("local")),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"},
     Cluster("jax", "JAX_COORDINATOR_ADDRESS", 4, 2, "10.0.0.1:1234", ("10.0.0.1", "", "", ""))),
    # The Ray launcher sets JAX's three variables and names itself.
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
      "OLMO_EQX_LAUNCHER": "ray"},
     Cluster("ray", "JAX_COORDINATOR_ADDRESS, OLMO_EQX_LAUNCHER=ray", 2, 0, "10.0.0.1:1234", ("10.0.0.1", ""))),
    ({"SLURM_NTASKS": "8", "SLURM_PROCID": "3", "SLURM_JOB_ID": "7"}, Cluster("slurm", "SLURM_NTASKS=8", 8, 3, jax_detects=True)),
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, Cluster("local")),  # one task: one host, no runtime
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:4", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
     Cluster("ompi", "OMPI_COMM_WORLD_SIZE", 2, 1, jax_detects=True)),
    (GKE_TWO_HOSTS, Cluster("gke-tpu", "TPU_WORKER_HOSTNAMES", 2, 1, f"pod-0.job:{_jax_port()}", ("pod-0.job", "pod-1.job"))),
    # JAX's process ids across slices: worker + slice * hosts per slice; process 0 is the
    # megascale coordinator; another slice's hosts are unknown here.
    (GKE_SLICES, Cluster("gke-tpu", "TPU_WORKER_HOSTNAMES, MEGASCALE_NUM_SLICES=2", 4, 3, f"s0-0.job:{_jax_port()}",
                         ("s0-0.job", "", "s1-0.job", "s1-1.job"))),
    ({**GKE_TWO_HOSTS, "JAX_COORDINATOR_PORT": "9999"},
     Cluster("gke-tpu", "TPU_WORKER_HOSTNAMES", 2, 1, "pod-0.job:9999", ("pod-0.job", "pod-1.job"))),
    # What a one-host GKE TPU pod gives (as read on the project's v5e device machine, 2026-12-07).
    ({"TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0", "TPU_SKIP_MDS_QUERY": "true",
      "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_HOST_BOUNDS": "1,1,1"}, Cluster("local", "TPU_WORKER_HOSTNAMES lists one host")),
    ({"OLMO_EQX_DISTRIBUTED": "1"}, Cluster("auto", "OLMO_EQX_DISTRIBUTED=1", None, None, jax_detects=True)),
])
def test_each_launchers_environment(env, expected):
    assert detect_cluster(env) == expected


@pytest.mark.parametrize("env, named", [
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "TPU_WORKER_ID (this host's place among them) is not set"),
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "2"}, "TPU_WORKER_ID=2 (of 2 hosts), slice 0 (of 1): out of range"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not a whole number"),
])
def test_an_inconsistent_environment_is_one_line(env, named):
    with pytest.raises(ClusterError, match="^[^\n]*$") as error:
        detect_cluster(env)
    assert named in str(error.value)


def test_a_tpu_vm_pod_from_its_metadata_server():
    """What JAX's GceTpuCluster reads (agent-worker-number, worker-network-endpoints in the
    name:id:ip form, slices from tpu-env), served by real HTTP servers on 127.0.0.1."""
    with tpu_vm_metadata(2) as servers:
        found = detect_cluster({"GCE_METADATA_IP": servers[1], "JAX_COORDINATOR_PORT": "1234"})
        assert found == Cluster("tpu-vm-pod", f"GCE metadata at http://{servers[1]}", 2, 1, "127.0.0.1:1234",
                                ("127.0.0.1", "127.0.0.1"))
    slices = "MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\nMEGASCALE_COORDINATOR_ADDRESS: '10.0.0.9'\n"
    with tpu_vm_metadata(2, tpu_env=slices) as servers:
        found = detect_cluster({"GCE_METADATA_IP": servers[0]})
        assert (found.num_processes, found.process_id, found.coordinator) == (4, 2, f"10.0.0.9:{_jax_port()}")
    with tpu_vm_metadata(1) as servers:  # a single TPU VM: one host, no runtime
        assert detect_cluster({"GCE_METADATA_IP": servers[0]}).kind == "local"


def test_this_machine_is_one_host():
    """libtpu is installed here but there is no TPU: JAX's TPU detectors stay off, nothing asks
    the metadata server (a name that resolves nowhere off GCE), and the run is local."""
    assert not running_on_tpu_vm()
    assert metadata_endpoint({}) is None
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "SLURM_", "TPU_WORKER", "OMPI_"))}
    assert detect_cluster(clean).kind == "local"
    from olmo_eqx.sharding import MeshConfig, make_mesh

    cluster = start_cluster()  # this test process: no launcher, no runtime started
    assert cluster.kind == "local" and not __import__("jax").distributed.is_initialized()
    line = cluster_line(cluster, make_mesh(MeshConfig()))
    # (libtpu, once loaded in this process by a TPU compile, sets TPU_WORKER_HOSTNAMES=localhost)
    assert re.match(r"cluster: local( \(TPU_WORKER_HOSTNAMES lists one host\))?, 1 process x 8 cpu devices, mesh ", line), line
    assert "fsdp=8" in line


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_bad_peer_timeout_is_one_line(value):
    with pytest.raises(ClusterError, match=f"^OLMO_EQX_PEER_TIMEOUT_S='{value}': give the seconds a host waits"):
        peer_timeout_s({"OLMO_EQX_PEER_TIMEOUT_S": value})
    assert peer_timeout_s({}) == 300.0 and peer_timeout_s({"OLMO_EQX_PEER_TIMEOUT_S": "2.5"}) == 2.5


def test_who_is_missing():
    gke = detect_cluster({**GKE_TWO_HOSTS, "TPU_WORKER_ID": "0"})
    assert "process 0 of 2: process 1 (pod-1.job) did not join within 5 s" in missing_peers_line(gke, 5.0, None)
    line = missing_peers_line(detect_cluster(GKE_TWO_HOSTS), 5.0, coordinator_up=False)
    assert f"process 1 of 2: process 0 (pod-0.job), the coordinator at pod-0.job:{_jax_port()}, did not come up" in line
    line = missing_peers_line(detect_cluster(GKE_SLICES), 5.0, coordinator_up=True)
    assert "process 3 of 4: some of processes 1, 2 (s1-0.job) did not join" in line  # no roll call
    line = missing_peers_line(detect_cluster(GKE_SLICES), 5.0, coordinator_up=True, present={0, 1, 3})
    assert "process 3 of 4: process 2 (s1-0.job) did not join (3 of 4 did) within 5 s" in line


# ---------------------------------------------------------------------------------------------
# Real processes on 127.0.0.1

# The 2 x 2-device run test_pretrain's jax/slurm launchers train, so their compiled steps are
# the suite's compilation cache hits.
RUN = [sys.executable, "-m", "olmo_eqx", *TINY, "trainer.stop_at=4", "trainer.eval_every=0"]


def _trained_as_one(processes, run_dir, first_line: str) -> None:
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    log = (run_dir / "train.log").read_text().splitlines()
    assert log[0].startswith(first_line) and "fsdp=4" in log[0], log[:3]
    assert log[0] in outputs[0] and "cluster:" not in outputs[1]  # process 0 says it, once
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"loss"' in line] == [1, 2, 3, 4]  # one run, written once


def test_gke_tpu_pods_start_one_run(tmp_path):
    """Each pod's command with the variables GKE's TPU webhook sets (TPU_WORKER_HOSTNAMES,
    TPU_WORKER_ID; the coordinator's port by JAX_COORDINATOR_PORT, which JAX reads too)."""
    processes = launch_local_cluster([*RUN, f"hydra.run.dir={tmp_path}"], merge_stderr=True, launcher="gke")
    _trained_as_one(processes, tmp_path, "cluster: gke-tpu (TPU_WORKER_HOSTNAMES), 2 processes x 2 cpu devices, mesh ")


def test_tpu_vm_pod_hosts_start_one_run(tmp_path):
    """`gcloud ... --worker=all` runs the same command on every host, whose environment says
    nothing: each host asks its metadata server (a real one per host here, GCE_METADATA_IP)."""
    with tpu_vm_metadata(2) as servers:
        processes = launch_local_cluster([*RUN, f"hydra.run.dir={tmp_path}"], merge_stderr=True, launcher="tpu-vm",
                                         metadata=servers)
        _trained_as_one(processes, tmp_path, f"cluster: tpu-vm-pod (GCE metadata at http://{servers[0]}), "
                                             "2 processes x 2 cpu devices, mesh ")


SLICE_SCRIPT = """
import jax
from olmo_eqx.infra.cluster import start_cluster
cluster = start_cluster()
print("OK", cluster.kind, cluster.source, jax.process_index(), jax.process_count(), jax.device_count(), flush=True)
"""


def test_gke_slices_join_with_jax_process_ids():
    """2 slices of 1 host (XPK --num-slices=2): MEGASCALE_SLICE_ID orders the processes."""
    processes = launch_local_cluster([sys.executable, "-c", SLICE_SCRIPT], launcher="gke-slices", devices_per_process=1)
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    for slice_id, (out, _) in enumerate(outputs):
        assert f"OK gke-tpu TPU_WORKER_HOSTNAMES, MEGASCALE_NUM_SLICES=2 {slice_id} 2 2" in out


def test_a_host_whose_peer_never_arrives_stops_saying_who(tmp_path):
    """Within OLMO_EQX_PEER_TIMEOUT_S a process whose peers do not all arrive stops with one line
    (exit status 2) naming the missing: 3 processes expected, 0 and 2 started, both name
    process 1 (the roll call says which; JAX's runtime cannot); and, as a job of its own, a
    worker whose coordinator never came up."""
    # Process 2 gives up first, while process 0 still answers (the other way round it says what
    # process 0 answered last); both lines are exact either way once each has heard the other.
    timeouts = {0: {"OLMO_EQX_PEER_TIMEOUT_S": "12"}, 2: {"OLMO_EQX_PEER_TIMEOUT_S": "6"}}
    started = time.monotonic()
    gathering = launch_local_cluster([*RUN, f"hydra.run.dir={tmp_path}"], n_processes=3, launcher="gke", ranks=[0, 2],
                                     rank_env=timeouts)
    (alone,) = launch_local_cluster([sys.executable, "-c", SLICE_SCRIPT], launcher="gke", ranks=[1],
                                    env={"OLMO_EQX_PEER_TIMEOUT_S": "4"})
    results = [p.communicate(timeout=120) for p in (*gathering, alone)]
    elapsed = time.monotonic() - started
    assert [p.returncode for p in (*gathering, alone)] == [2, 2, 2], results
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for _, err in results]
    assert [len(e) for e in errors] == [1, 1, 1], results
    for me, seconds, (line,) in zip((0, 2), (12, 6), errors):
        assert line.startswith(f"error: cluster gke-tpu (TPU_WORKER_HOSTNAMES): process {me} of 3: process 1 (127.0.0.1) "
                               f"did not join (2 of 3 did) within {seconds} s. Check that every pod of the JobSet runs "
                               "the same command"), line
        assert f"raise OLMO_EQX_PEER_TIMEOUT_S (now {seconds})" in line
    assert "process 1 of 2: process 0 (127.0.0.1), the coordinator at 127.0.0.1:" in errors[2][0]
    assert "did not come up within 4 s" in errors[2][0]
    assert not any("Check failure stack trace" in err for _, err in results)  # ours, not JAX's abort
    assert not (tmp_path / "train.log").exists()  # stopped before the run began
    assert elapsed < 60
