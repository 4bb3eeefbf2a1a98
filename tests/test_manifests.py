"""The launch command or file of each cluster kind (`olmo_eqx.infra.manifests`), checked as far
as a machine without a cluster allows: the chips-per-host table against Cloud TPU's published
slice shapes, the gcloud and xpk lines' quoting through a real shell, the JobSet manifest
through two published schemas (the Kubernetes client's Job models and Kubeflow Trainer's
JobSet v1alpha2 models, both pydantic models that refuse a wrong type or a missing required
field, and that drop a field they do not know, which the round trip below catches), and the
command every host runs composed as a config. No JAX compile; xpk's own parser and SkyPilot's
task parser check the same outputs in `scripts/check_launch_files.py`, since those tools
install too much for the suite.
"""

import atexit
import functools
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml
from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
from kubernetes.client import ApiClient, V1JobTemplateSpec

from olmo_eqx.config import compose_config
from olmo_eqx.infra import manifests
from olmo_eqx.infra.manifests import TPU_TYPES, Launch, LaunchError, main, render, tpu_type

BUCKET = "gs://my-bucket/runs/olmo7b"
# Overrides a shell could mangle: a query string with '&', a space, brackets, a '$', quotes.
TRICKY = (
    "+stage=pretrain",
    "model=olmo3_nano",
    "data.tokenizer=https://huggingface.co/allenai/dolma2-tokenizer/resolve/main/tokenizer.json?download=1&x=2",
    "trainer.steps=12",
    "optim.lr=3e-4",
    "+note='a run; of $HOME'",
)


def launch(tpu="v5p-256", slices=1, overrides=TRICKY, **kw) -> Launch:
    return Launch(name="olmo7b", tpu=tpu_type(tpu), overrides=tuple(overrides), checkpoint_dir=BUCKET,
                  slices=slices, image="us-docker.pkg.dev/p/r/olmo_eqx:1", **kw)


# (type, chips, topology, hosts as TPU VMs, chips per TPU VM, GKE nodes, GKE accelerator label):
# Cloud TPU's v4/v5p/v5e/v6e pages, and XPK 1.16.0's table for GKE (4-chip nodes).
KNOWN = [
    ("v5p-8", 4, "2x2x1", 1, 4, 1, "tpu-v5p-slice"),
    ("v5p-256", 128, "4x4x8", 32, 4, 32, "tpu-v5p-slice"),
    ("v5p-8192", 4096, "16x16x16", 1024, 4, 1024, "tpu-v5p-slice"),
    ("v4-8", 4, "2x2x1", 1, 4, 1, "tpu-v4-podslice"),
    ("v4-4096", 2048, "8x16x16", 512, 4, 512, "tpu-v4-podslice"),
    ("v5litepod-1", 1, "1x1", 1, 1, 1, "tpu-v5-lite-podslice"),
    ("v5litepod-4", 4, "2x2", 1, 4, 1, "tpu-v5-lite-podslice"),
    ("v5litepod-8", 8, "2x4", 1, 8, 2, "tpu-v5-lite-podslice"),
    ("v5litepod-16", 16, "4x4", 4, 4, 4, "tpu-v5-lite-podslice"),
    ("v5litepod-256", 256, "16x16", 64, 4, 64, "tpu-v5-lite-podslice"),
    ("v6e-8", 8, "2x4", 1, 8, 2, "tpu-v6e-slice"),
    ("v6e-32", 32, "4x8", 8, 4, 8, "tpu-v6e-slice"),
    ("v6e-256", 256, "16x16", 64, 4, 64, "tpu-v6e-slice"),
]


@pytest.mark.parametrize("name,chips,topology,vm_hosts,per_vm,gke_nodes,accelerator", KNOWN)
def test_tpu_type_chips_hosts_and_topology(name, chips, topology, vm_hosts, per_vm, gke_nodes, accelerator):
    t = tpu_type(name)
    assert (t.chips, t.topology, t.vm_hosts, t.chips_per_vm, t.gke_nodes, t.gke_accelerator) == (
        chips, topology, vm_hosts, per_vm, gke_nodes, accelerator)


def test_every_tpu_type_adds_up():
    for t in TPU_TYPES.values():
        assert math.prod(int(d) for d in t.topology.split("x")) == t.chips, t
        assert t.vm_hosts * t.chips_per_vm == t.chips and t.gke_nodes * t.chips_per_gke_node == t.chips, t
        cores = 2 if t.generation in ("v4", "v5p") else 1  # v4/v5p names count TensorCores
        assert t.name == f"{t.generation}-{t.chips * cores}", t
        # A pod's hostname, <name>-slice-<slice>-<index>, is a DNS label (63 at most) even for
        # the longest run name and 64 slices of the largest type.
        assert len(f"{'x' * manifests.NAME_MAX}-{manifests.REPLICATED_JOB}-63-{t.gke_nodes - 1}") <= 63, t


@pytest.mark.parametrize("name,fix", [("v5e-16", "v5litepod-16"), ("v5p-7", "v5p-{8,16"), ("tpu-v6e-8", "v6e-{1,4,8")])
def test_unknown_tpu_type_is_refused_naming_the_known_ones(name, fix, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["xpk", "--name", "olmo7b", "--tpu-type", name, "--checkpoint-dir", BUCKET, "--", "+stage=pretrain"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --tpu-type={name}: unknown TPU type") and fix in err


@functools.cache
def fake_bin() -> str:
    """A directory whose `python3` prints its argv (NUL-separated) and whose `pip` does nothing."""
    directory = tempfile.mkdtemp(prefix="olmo_eqx-fake-bin-")
    atexit.register(shutil.rmtree, directory, True)
    for name, body in (("python3", 'printf "%s\\0" "$@"'), ("pip", "true")):
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/sh\n{body}\n")
        os.chmod(path, 0o755)
    return directory


def shell_argv(command: str) -> list[str]:
    """The argv `python3` gets when bash runs `command` (as ssh runs --command on each host, and
    a container `bash -c`), with python3 an executable that prints its arguments."""
    env = {"HOME": "/home/u", "PATH": f"{fake_bin()}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", command], capture_output=True, check=True, env=env)
    return ["python3", *out.stdout.decode().split("\0")[:-1]]


@pytest.mark.parametrize("slices", [1, 2])
def test_tpu_vm_line_gives_every_host_the_exact_argv(slices):
    run = launch(slices=slices, setup="pip install -e '.[tpu]'")
    line = render("tpu-vm", run, zone="us-east5-a", project="my-project")
    argv = shlex.split(line)  # the user's shell
    if slices == 1:
        assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "olmo7b"] and "--worker=all" in argv
    else:
        assert argv[:6] == ["gcloud", "compute", "tpus", "queued-resources", "ssh", "olmo7b"]
        assert "--node=all" in argv and "--worker=all" in argv
        # every host of every slice at once (gcloud's default batch is 64 hosts; here 2 x 32)
        assert argv[argv.index("--batch-size") + 1] == str(slices * 32)
    assert argv[argv.index("--zone") + 1] == "us-east5-a" and argv[argv.index("--project") + 1] == "my-project"
    command = argv[argv.index("--command") + 1]
    host_argv = shell_argv(command)  # each host's shell
    assert host_argv == run.argv()
    assert host_argv[-2:] == ["hydra.run.dir=/tmp/olmo_eqx/olmo7b", f"checkpoint.dir={BUCKET}"]
    assert "+note='a run; of $HOME'" in host_argv and TRICKY[2] in host_argv


def test_xpk_line_flags_and_command():
    run = launch(tpu="v5litepod-16", slices=2, max_restarts=5)
    argv = shlex.split(render("xpk", run, cluster="my-cluster", zone="us-east5-b"))
    assert argv[:3] == ["xpk", "workload", "create"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {
        "--cluster": "my-cluster", "--workload": "olmo7b", "--tpu-type": "v5litepod-16", "--num-slices": "2",
        "--docker-image": run.image, "--command": flags["--command"], "--max-restarts": "5",
        "--restart-on-exit-codes": "1,2", "--zone": "us-east5-b",
    }
    assert shell_argv(flags["--command"]) == run.argv()


def roundtrip_equal(document: dict, model) -> None:
    """`document` read by `model` and written back is `document`: no field dropped (misnamed),
    none retyped; a missing required field or a wrong type raises."""
    assert ApiClient().sanitize_for_serialization(model.from_dict(document)) == document


@pytest.mark.parametrize("tpu,slices,setup", [("v5p-256", 2, ""), ("v5litepod-16", 1, ""), ("v6e-8", 1, "pip install -e .")])
def test_jobset_manifest_validates_against_published_models(tpu, slices, setup):
    run = launch(tpu=tpu, slices=slices, setup=setup, max_restarts=7)
    document = yaml.safe_load(render("jobset", run))
    roundtrip_equal(document, JobsetV1alpha2JobSet)
    (rjob,) = document["spec"]["replicatedJobs"]
    roundtrip_equal(rjob["template"], V1JobTemplateSpec)

    t = tpu_type(tpu)
    assert document["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and document["kind"] == "JobSet"
    assert document["spec"]["failurePolicy"] == {"maxRestarts": 7}
    assert document["spec"]["network"]["enableDNSHostnames"] is True
    assert rjob["replicas"] == slices
    job = rjob["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == t.gke_nodes
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": t.gke_accelerator,
                                   "cloud.google.com/gke-tpu-topology": t.topology}
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": str(t.chips_per_gke_node)}
    if setup:
        # bash runs the setup, then is replaced by Python, which then gets the pod's SIGTERM itself
        assert container["command"][:2] == ["bash", "-c"] and shell_argv(container["command"][2]) == run.argv()
        assert container["command"][2].startswith(f"{setup} && exec python3 -m olmo_eqx ")
    else:
        assert container["command"] == run.argv()


def test_a_misnamed_field_does_not_survive_the_roundtrip():
    """The check above can fail: a typo'd field is dropped by the models, so the round trip differs."""
    document = yaml.safe_load(render("jobset", launch()))
    document["spec"]["failurePolicy"]["maxRestart"] = 3
    with pytest.raises(AssertionError):
        roundtrip_equal(document, JobsetV1alpha2JobSet)
    template = document["spec"]["replicatedJobs"][0]["template"]
    template["spec"]["template"]["spec"]["nodeSelecter"] = {}
    with pytest.raises(AssertionError):
        roundtrip_equal(template, V1JobTemplateSpec)


def test_skypilot_task():
    run = launch(tpu="v6e-32", max_restarts=2)
    task = yaml.safe_load(render("skypilot", run))
    assert task["resources"]["accelerators"] == "tpu-v6e-32"
    assert task["resources"]["accelerator_args"] == {"runtime_version": "v2-alpha-tpuv6e"}
    assert task["resources"]["job_recovery"] == {"max_restarts_on_errors": 2}
    assert task["num_nodes"] == 1 and task["workdir"] == "."
    assert shell_argv(task["run"]) == run.argv()


def test_every_kind_runs_the_same_command():
    run = launch(tpu="v5litepod-16")
    tpu_vm = shlex.split(render("tpu-vm", run, zone="z"))
    xpk = shlex.split(render("xpk", run, cluster="c"))
    jobset = yaml.safe_load(render("jobset", run))["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    sky = yaml.safe_load(render("skypilot", run))
    assert (shell_argv(tpu_vm[tpu_vm.index("--command") + 1]) == shell_argv(xpk[xpk.index("--command") + 1])
            == jobset["containers"][0]["command"] == shell_argv(sky["run"]) == run.argv())


def test_the_command_is_a_config_that_composes():
    """What every host runs is a valid run config, with the bucket as its checkpoint dir."""
    run = launch(overrides=("+stage=pretrain", "+recipe=olmo3_7b_stage1", "trainer.micro_batches=8"))
    config = compose_config([a for a in run.argv()[3:] if not a.startswith("hydra.")])
    assert config.checkpoint.dir == BUCKET and config.trainer.micro_batches == 8


REFUSALS = [
    (["tpu-vm", "--tpu-type", "v5p-256", "--checkpoint-dir", BUCKET, "--", "+stage=pretrain"], "--zone"),
    (["tpu-vm", "--zone", "z", "--tpu-type", "v5p-256", "--checkpoint-dir", "/mnt/runs/x", "--", "+stage=pretrain"],
     "--checkpoint-dir=/mnt/runs/x: the hosts of a pod share no file system"),
    (["tpu-vm", "--zone", "z", "--tpu-type", "v5p-256", "--checkpoint-dir", BUCKET, "--", "model=olmo3_nano"], "no stage"),
    (["tpu-vm", "--zone", "z", "--tpu-type", "v5p-256", "--checkpoint-dir", BUCKET, "--", "+stage=pretrain",
      "hydra.run.dir=runs/x"], "--run-dir"),
    (["tpu-vm", "--zone", "z", "--tpu-type", "v5p-256", "--checkpoint-dir", BUCKET, "--", "+stage=pretrain",
      "checkpoint.dir=gs://b/y"], "--checkpoint-dir"),
    (["xpk", "--cluster", "c", "--tpu-type", "v5p-256", "--checkpoint-dir", BUCKET, "--", "+stage=pretrain"], "--image"),
    (["xpk", "--image", "i", "--tpu-type", "v5p-256", "--checkpoint-dir", BUCKET, "--", "+stage=pretrain"], "--cluster"),
    (["jobset", "--image", "i", "--tpu-type", "v5litepod-4", "--slices", "2", "--checkpoint-dir", BUCKET, "--",
      "+stage=pretrain"], "multi-host"),
    (["skypilot", "--tpu-type", "v5litepod-16", "--slices", "2", "--checkpoint-dir", BUCKET, "--", "+stage=pretrain"],
     "one TPU slice"),
    (["jobset", "--image", "i", "--tpu-type", "v5p-8", "--checkpoint-dir", BUCKET, "--run-dir", "runs/x", "--",
      "+stage=pretrain"], "absolute path"),
]


@pytest.mark.parametrize("argv,says", REFUSALS)
def test_refusals_are_one_line_with_status_2(argv, says, capsys):
    name = ["--name", "olmo7b"]
    with pytest.raises(SystemExit) as stop:
        main(argv[:1] + name + argv[1:])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and says in err, err


@pytest.mark.parametrize("name", ["Olmo7b", "olmo_7b", "7b", "x" * 41, "olmo-"])
def test_a_name_that_cannot_name_a_workload_is_refused(name):
    with pytest.raises(LaunchError, match="--name="):
        render("jobset", Launch(name=name, tpu=tpu_type("v5p-8"), overrides=("+stage=pretrain",),
                                checkpoint_dir=BUCKET, image="i"))


def test_module_entry_writes_the_file(tmp_path):
    out = tmp_path / "jobset.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "olmo_eqx.infra.manifests", "jobset", "--name", "olmo7b", "--tpu-type", "v5p-256",
         "--slices", "2", "--image", "i", "--checkpoint-dir", BUCKET, "--out", str(out), "--", "+stage=pretrain"],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    document = yaml.safe_load(out.read_text())
    assert document["spec"]["replicatedJobs"][0]["replicas"] == 2
    assert "plan it first: python -m olmo_eqx.plan +plan.target=tpu:v5p:4x4x8:2" in out.read_text()


def test_the_planner_target_named_in_the_files_is_the_same_slice():
    from olmo_eqx.plan.targets import parse_target

    for t in TPU_TYPES.values():
        if t.plan_target is None:  # v4: the planner knows no v4 chip
            assert t.generation == "v4"
            continue
        target = parse_target(f"{t.plan_target}:2")
        assert (target.topology, target.slices, target.n_devices) == (t.topology, 2, 2 * t.chips), t
