"""`python -m olmo_eqx.infra.manifests KIND ...`: the launch command or file of one run, per cluster kind.

    tpu-vm     the `gcloud compute tpus tpu-vm ssh NAME --worker=all --command ...` line
               (several slices: `gcloud compute tpus queued-resources ssh NAME --node=all ...`)
    xpk        the `xpk workload create ... --command ...` line (GKE through XPK)
    jobset     a JobSet manifest (GKE without XPK): `kubectl apply -f` it
    skypilot   a SkyPilot task YAML: `sky jobs launch` it

Every kind ends in the same command on every host, `python3 -m olmo_eqx <overrides>
hydra.run.dir=<run dir> checkpoint.dir=<bucket>`; each process finds its peers from what its
launcher gave it (`olmo_eqx.infra`), so nothing here sets JAX's variables. The run directory is
pinned to one absolute path, the same string on every host and every restart (each host would
otherwise compute its own `${now:}` directory, and the checkpoint prefix's owner check compares
that string); the checkpoints go to a bucket, since a pod's hosts share no file system, and a
restart resumes from the newest step committed there.

The chips-per-host arithmetic is in `TPU_TYPES`: Cloud TPU names v4 and v5p slices by
TensorCores (two a chip: v5p-256 is 128 chips, 32 hosts of 4) and v5e (`v5litepod`) and v6e by
chips; a TPU VM of 8 v5e/v6e chips is one host (ct5lp-hightpu-8t, ct6e-standard-8t), while GKE
node pools of those topologies are built of 4-chip nodes, as XPK's own table has them
(`xpk/core/system_characteristics.py`), which is what multi-slice needs there.
"""

import argparse
import dataclasses
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, Optional

import yaml

from olmo_eqx.errors import RunError

KINDS = ("tpu-vm", "xpk", "jobset", "skypilot")
PYTHON = "python3"
DEFAULT_RUN_ROOT = "/tmp/olmo_eqx"
CONTAINER = "olmo-eqx"
# One Job per slice in the JobSet; the name appears in every pod's hostname.
REPLICATED_JOB = "slice"
# XPK restarts only on the exit statuses it is told (42 and 127-255 by default). A process
# whose peer is lost (a preempted host) stops with status 2, as bad input does, and a crash is
# status 1: both restart, as a JobSet with no failure rules restarts on any failure.
XPK_RESTART_EXIT_CODES = "1,2"
# SIGTERM makes a run finish its step and save (README, "Resuming and interruptions"); Kubernetes'
# default 30 s is too short for a large model's save to reach the bucket.
TERMINATION_GRACE_S = 300
# What the bucket holds must outlive every host.
BUCKET_SCHEMES = ("gs://", "s3://")
# Kubernetes and XPK names: a DNS label, at most 40 characters (XPK's own limit; JobSet adds
# "-slice-<job>-<pod>" to it for each pod's hostname, which must stay within 63).
NAME_PATTERN = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
NAME_MAX = 40


class LaunchError(RunError):
    """A launch request that cannot be written (unknown TPU type, missing setting); the message
    names the input and the fix."""


@dataclasses.dataclass(frozen=True)
class TpuType:
    """One Cloud TPU slice type: its chips, topology and hosts, on TPU VMs and on GKE."""

    name: str  # as Cloud TPU, XPK and SkyPilot (with "tpu-") spell it: v5p-256, v5litepod-16
    generation: str  # v4, v5p, v5litepod, v6e
    topology: str  # 4x4x8, 4x4
    chips: int
    chips_per_vm: int  # chips per TPU VM host (gcloud, SkyPilot)
    chips_per_gke_node: int  # chips per GKE node (google.com/tpu of each pod)
    gke_accelerator: str  # the node label cloud.google.com/gke-tpu-accelerator
    runtime_version: str  # the TPU VM software version for this generation

    @property
    def vm_hosts(self) -> int:
        return self.chips // self.chips_per_vm

    @property
    def gke_nodes(self) -> int:
        return self.chips // self.chips_per_gke_node

    @property
    def plan_target(self) -> Optional[str]:
        """The planner's name for one slice of this type (`python -m olmo_eqx.plan +plan.target=...`);
        None for v4, which the planner does not know."""
        generation = "v5e" if self.generation == "v5litepod" else self.generation
        return None if generation == "v4" else f"tpu:{generation}:{self.topology}"


# Cloud TPU's slice shapes (docs.cloud.google.com/tpu/docs/{v4,v5p,v5e,v6e}; the same topologies
# as XPK's table): 3-D tori for v4/v5p, 2-D for v5e/v6e, keyed by chips.
_TORUS_3D = {
    4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
    512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16",
}
_TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
# generation: (TensorCores a chip, as the name counts; GKE accelerator label; runtime version; largest slice in chips)
_GENERATIONS = {
    "v4": (2, "tpu-v4-podslice", "tpu-ubuntu2204-base", 2048),
    "v5p": (2, "tpu-v5p-slice", "v2-alpha-tpuv5", 4096),
    "v5litepod": (1, "tpu-v5-lite-podslice", "v2-alpha-tpuv5-lite", 256),
    "v6e": (1, "tpu-v6e-slice", "v2-alpha-tpuv6e", 256),
}


def _tpu_types() -> dict[str, TpuType]:
    types = {}
    for generation, (cores, accelerator, runtime, largest) in _GENERATIONS.items():
        shapes = _TORUS_3D if generation in ("v4", "v5p") else _TORUS_2D
        for chips, topology in shapes.items():
            if chips > largest:
                continue
            # A v5e/v6e TPU VM holds up to 8 chips (one host up to v5litepod-8); larger
            # slices are hosts of 4. v4/v5p hosts hold 4. GKE nodes hold 4 (1 for one chip).
            per_vm = chips if (cores == 1 and chips <= 8) else 4
            per_node = min(chips, 4)
            name = f"{generation}-{chips * cores}"
            types[name] = TpuType(name, generation, topology, chips, per_vm, per_node, accelerator, runtime)
    return types


TPU_TYPES = _tpu_types()


def _known_types() -> str:
    by_generation: dict[str, list[str]] = {}
    for t in TPU_TYPES.values():
        by_generation.setdefault(t.generation, []).append(t.name.split("-")[1])
    return "; ".join(f"{g}-{{{','.join(sizes)}}}" for g, sizes in by_generation.items())


def tpu_type(name: str) -> TpuType:
    """The slice type `name` (v5p-256, v5litepod-16, v6e-32, v4-8); `LaunchError` names the known ones."""
    if name in TPU_TYPES:
        return TPU_TYPES[name]
    hint = ""
    if m := re.fullmatch(r"v5e-(\d+)", name):
        hint = f" (Cloud TPU names v5e slices v5litepod-N: v5litepod-{m.group(1)})"
    raise LaunchError(f"--tpu-type={name}: unknown TPU type{hint}; known: {_known_types()}")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One run to launch: what every host runs, where, on what."""

    name: str
    tpu: TpuType
    overrides: tuple[str, ...]
    checkpoint_dir: str
    slices: int = 1
    run_dir: str = ""  # default: DEFAULT_RUN_ROOT/<name>
    setup: str = ""  # shell run on every host before training (installing the project)
    image: str = ""  # container image (xpk, jobset)
    max_restarts: int = 3

    @property
    def pinned_run_dir(self) -> str:
        return self.run_dir or f"{DEFAULT_RUN_ROOT}/{self.name}"

    def argv(self) -> list[str]:
        """The command every host runs, as its argv."""
        return [
            PYTHON, "-m", "olmo_eqx", *self.overrides,
            f"hydra.run.dir={self.pinned_run_dir}", f"checkpoint.dir={self.checkpoint_dir}",
        ]

    def shell_command(self) -> str:
        """The command every host runs, as one line of shell (the setup first, if any). After a
        setup the shell `exec`s Python, so that a SIGTERM (a drained node, a deleted workload)
        reaches the run, which then saves, rather than a shell that would not pass it on."""
        command = shlex.join(self.argv())
        return f"{self.setup} && exec {command}" if self.setup else command


def check_launch(launch: Launch, kind: str) -> None:
    """Refuse, in one line naming the setting and the fix, what would not run on every host."""
    if not NAME_PATTERN.fullmatch(launch.name) or len(launch.name) > NAME_MAX:
        raise LaunchError(
            f"--name={launch.name}: a run name must be lowercase letters, digits and '-', start with a letter, "
            f"end with a letter or digit, at most {NAME_MAX} characters (it names the workload and every pod)"
        )
    if not launch.checkpoint_dir.startswith(BUCKET_SCHEMES) or launch.checkpoint_dir.rstrip("/") in BUCKET_SCHEMES:
        raise LaunchError(
            f"--checkpoint-dir={launch.checkpoint_dir}: the hosts of a pod share no file system, and a restart "
            "may land on other machines: give a bucket, e.g. --checkpoint-dir=gs://my-bucket/runs/" + launch.name
        )
    if not launch.run_dir.startswith("/") and launch.run_dir:
        raise LaunchError(f"--run-dir={launch.run_dir}: give an absolute path, the same string on every host")
    if launch.slices < 1:
        raise LaunchError(f"--slices={launch.slices}: give 1 or more")
    if launch.max_restarts < 0:
        raise LaunchError(f"--max-restarts={launch.max_restarts}: give 0 or more")
    if not any(o.startswith("+stage=") or o.startswith("stage=") for o in launch.overrides):
        raise LaunchError(
            "no stage among the overrides: name one, e.g. `... -- +stage=pretrain +recipe=olmo3_7b_stage1` "
            "(without it `python -m olmo_eqx` only lists the stages)"
        )
    for override in launch.overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "hydra.run.dir":
            raise LaunchError(f"{override}: the run dir is pinned for every host by --run-dir (default {DEFAULT_RUN_ROOT}/<name>)")
        if key == "checkpoint.dir":
            raise LaunchError(f"{override}: give the bucket as --checkpoint-dir, which every host gets")
        if key in ("-m", "--multirun") or override.startswith("hydra/launcher="):
            raise LaunchError(f"{override}: a sweep cannot run on a pod's hosts; launch one run per workload")
    if kind in ("xpk", "jobset"):
        if not launch.image:
            raise LaunchError(f"{kind}: give the container image every pod runs, --image=REGISTRY/IMAGE:TAG (with olmo_eqx[tpu] installed)")
        if launch.slices > 1 and launch.tpu.gke_nodes == 1:
            raise LaunchError(
                f"--slices={launch.slices} of {launch.tpu.name}: GKE runs several slices only on multi-host slice "
                "node pools; choose a type of 8 chips or more, or --slices=1"
            )
    if kind == "skypilot" and launch.slices > 1:
        raise LaunchError(
            f"--slices={launch.slices}: a SkyPilot task here is one TPU slice (its run: runs on every host of it); "
            "run several slices with xpk or jobset (GKE), or tpu-vm (queued resources)"
        )


def tpu_vm_command(launch: Launch, zone: str, project: Optional[str] = None) -> list[str]:
    """The gcloud argv that runs the command on every host of the TPU VM `launch.name` (for
    several slices: every host of every node of the queued resource `launch.name`)."""
    if launch.slices > 1:
        # queued-resources ssh starts the command on 64 hosts at a time by default (gcloud's
        # reference): with more, the first 64 would wait for peers that start only after they end.
        hosts = launch.slices * launch.tpu.vm_hosts
        argv = ["gcloud", "compute", "tpus", "queued-resources", "ssh", launch.name, "--zone", zone, "--node=all",
                "--worker=all", "--batch-size", str(hosts)]
    else:
        argv = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", launch.name, "--zone", zone, "--worker=all"]
    if project:
        argv += ["--project", project]
    return argv + ["--command", launch.shell_command()]


def xpk_command(launch: Launch, cluster: str, project: Optional[str] = None, zone: Optional[str] = None) -> list[str]:
    """The `xpk workload create` argv of `launch` (flags as xpk's parser defines them)."""
    argv = [
        "xpk", "workload", "create", "--cluster", cluster, "--workload", launch.name,
        "--tpu-type", launch.tpu.name, "--num-slices", str(launch.slices), "--docker-image", launch.image,
        "--command", launch.shell_command(),
        "--max-restarts", str(launch.max_restarts), "--restart-on-exit-codes", XPK_RESTART_EXIT_CODES,
    ]
    if project:
        argv += ["--project", project]
    if zone:
        argv += ["--zone", zone]
    return argv


def container_command(launch: Launch) -> list[str]:
    """The container's command: the argv itself, or bash running the setup and then it."""
    return ["bash", "-c", launch.shell_command()] if launch.setup else launch.argv()


def jobset_manifest(launch: Launch) -> dict:
    """A JobSet (jobset.x-k8s.io/v1alpha2) of one Indexed Job per slice, one pod per TPU node.

    JobSet gives the pods a headless service named after the JobSet and stable hostnames
    (`<name>-slice-<slice>-<host>.<name>`); GKE's TPU support sets TPU_WORKER_ID and
    TPU_WORKER_HOSTNAMES from them (and MEGASCALE_* for several slices), which JAX's GKE cluster
    detection reads. The exclusive-topology annotation puts each slice's Job on one node pool,
    i.e. one physical slice."""
    tpu = launch.tpu
    pod_spec = {
        "restartPolicy": "Never",
        # The TPU runtime's and the processes' ports on the node itself, as GKE's multislice examples do.
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
            "cloud.google.com/gke-tpu-topology": tpu.topology,
        },
        "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [
            {
                "name": CONTAINER,
                "image": launch.image,
                "command": container_command(launch),
                "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
                "resources": {"limits": {"google.com/tpu": str(tpu.chips_per_gke_node)}},
            }
        ],
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": launch.name,
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
        },
        "spec": {
            # Any failed Job (a pod lost, or a process that stopped) recreates every Job: the run
            # resumes from the newest step committed under checkpoint.dir.
            "failurePolicy": {"maxRestarts": launch.max_restarts},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": launch.slices,
                    "template": {
                        "spec": {
                            "completionMode": "Indexed",
                            "parallelism": tpu.gke_nodes,
                            "completions": tpu.gke_nodes,
                            "backoffLimit": 0,
                            "template": {"spec": pod_spec},
                        }
                    },
                }
            ],
        },
    }


# google-auth: the hosts' credentials for gs:// (a TPU VM's service account), which olmo_eqx
# uses when it is installed and otherwise goes anonymous.
DEFAULT_SKYPILOT_SETUP = "pip install -c constraints.txt -e '.[tpu]' google-auth"


def skypilot_task(launch: Launch) -> dict:
    """A SkyPilot task: one TPU slice (a TPU VM pod counts as one node and SkyPilot runs `run:`
    on each of its hosts), the project synced from the working directory and installed by
    `setup:` on each host; `job_recovery` relaunches it after a preemption or a failure when
    started with `sky jobs launch`."""
    tpu = launch.tpu
    return {
        "name": launch.name,
        "resources": {
            "accelerators": f"tpu-{tpu.name}",
            "accelerator_args": {"runtime_version": tpu.runtime_version},
            "job_recovery": {"max_restarts_on_errors": launch.max_restarts},
        },
        "num_nodes": 1,
        "workdir": ".",
        "setup": launch.setup or DEFAULT_SKYPILOT_SETUP,
        "run": shlex.join(launch.argv()),
    }


def _yaml(document: dict, comment: str) -> str:
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    return header + yaml.safe_dump(document, sort_keys=False, width=10_000)


def render(kind: str, launch: Launch, *, zone: Optional[str] = None, project: Optional[str] = None,
           cluster: Optional[str] = None) -> str:
    """The text for `kind`: a shell line (tpu-vm, xpk) or a YAML file (jobset, skypilot)."""
    if kind not in KINDS:
        raise LaunchError(f"{kind}: unknown cluster kind; choose one of {', '.join(KINDS)}")
    check_launch(launch, kind)
    tpu = launch.tpu
    slices = f"{launch.slices} x " if launch.slices > 1 else ""
    if kind == "tpu-vm":
        if not zone:
            raise LaunchError("tpu-vm: give the TPU VM's zone, --zone=us-east5-a")
        return shlex.join(tpu_vm_command(launch, zone, project)) + "\n"
    if kind == "xpk":
        if not cluster:
            raise LaunchError("xpk: give the GKE cluster xpk created, --cluster=NAME")
        return shlex.join(xpk_command(launch, cluster, project, zone)) + "\n"
    about = (
        f"olmo_eqx run {launch.name}: {slices}{tpu.name} ({tpu.chips} chips, topology {tpu.topology}), "
        f"written by python -m olmo_eqx.infra.manifests {kind}"
    )
    if tpu.plan_target:
        plan = f"{tpu.plan_target}:{launch.slices}" if launch.slices > 1 else tpu.plan_target
        about += f"\nplan it first: python -m olmo_eqx.plan +plan.target={plan} (with the run's overrides)"
    if kind == "jobset":
        return _yaml(jobset_manifest(launch), f"{about}\nkubectl apply -f this file (JobSet v0.5+ installed on the GKE cluster)")
    return _yaml(skypilot_task(launch), f"{about}\nsky jobs launch this file from the repository's root (its workdir)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every refusal of the project
        print(f"error: {message} (see python -m olmo_eqx.infra.manifests --help)", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m olmo_eqx.infra.manifests",
        description="Write the command or file that runs `python -m olmo_eqx OVERRIDES` on every host of a TPU\n"
        "slice (or several), with a pinned run dir and checkpoints in a bucket. docs/cluster.md has each kind.",
        epilog="example:\n  python -m olmo_eqx.infra.manifests xpk --name olmo7b --tpu-type v5p-256 --slices 2 \\\n"
        "      --cluster my-cluster --image us-docker.pkg.dev/p/r/olmo_eqx:latest --checkpoint-dir gs://b/olmo7b \\\n"
        "      -- +stage=pretrain +recipe=olmo3_7b_stage1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s KIND --name NAME --tpu-type TYPE --checkpoint-dir gs://... [options] -- OVERRIDE...",
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--name", required=True, help="run name: the TPU VM / queued resource, workload, JobSet or task name")
    p.add_argument("--tpu-type", required=True, help="slice type as Cloud TPU names it: v5p-256, v5litepod-16, v6e-32, v4-8")
    p.add_argument("--slices", type=int, default=1, help="slices joined over the data-center network (default 1)")
    p.add_argument("--checkpoint-dir", required=True, help="gs://bucket/prefix (or s3://) every host writes to")
    p.add_argument("--run-dir", default="", help=f"absolute run dir, the same on every host (default {DEFAULT_RUN_ROOT}/NAME)")
    p.add_argument("--setup", default="", help="shell run on every host first (e.g. installing the project)")
    p.add_argument("--image", default="", help="container image (xpk, jobset)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after a failure (xpk, jobset, skypilot; default 3)")
    p.add_argument("--zone", help="zone (tpu-vm: required; xpk: optional)")
    p.add_argument("--project", help="Google Cloud project (tpu-vm, xpk; default: gcloud's)")
    p.add_argument("--cluster", help="GKE cluster (xpk)")
    p.add_argument("--out", help="write to this file instead of stdout")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The run's overrides follow `--` untouched (argparse would read `+stage=...` as its own).
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:split])
    overrides = tuple(argv[split + 1:])
    try:
        launch = Launch(
            name=args.name, tpu=tpu_type(args.tpu_type), overrides=overrides,
            checkpoint_dir=args.checkpoint_dir, slices=args.slices, run_dir=args.run_dir, setup=args.setup,
            image=args.image, max_restarts=args.max_restarts,
        )
        text = render(args.kind, launch, zone=args.zone, project=args.project, cluster=args.cluster)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
