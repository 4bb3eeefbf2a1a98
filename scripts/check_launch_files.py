"""Check the launch lines and files of `python -m olmo_eqx.infra.manifests` with the launchers'
own code, where it is installed: xpk's argument parser and its TPU table, and SkyPilot's task
parser. Installs nothing.

    python scripts/check_launch_files.py [--xpk-python PATH] [--sky-python PATH] [--keep DIR] [--require]

Neither installs beside the project's pinned versions (constraints.txt): xpk 1.16.0 pins
tabulate==0.9.0 (the lock has 0.10.0) and pulls Google Cloud's AI Platform SDK and ~35 more
packages; SkyPilot 0.14.1 needs click<8.2 (the lock has 8.5.1) and ~30 more. So they are not test
dependencies; install each in a virtual environment of its own and name its interpreter:

    python -m venv /tmp/xpk && /tmp/xpk/bin/pip install xpk==1.16.0          # 2.7 min here
    python -m venv /tmp/sky && /tmp/sky/bin/pip install skypilot==0.14.1     # 2.2 min here
    python scripts/check_launch_files.py --xpk-python /tmp/xpk/bin/python --sky-python /tmp/sky/bin/python

Without `--xpk-python`/`--sky-python` the check runs in this interpreter if the tool imports
here. What it checks:
  xpk       every written `xpk workload create` line parses with xpk's own parser (`xpk.parser.core.
            set_parser`), giving back the command, TPU type, slices, image and restart settings
            written, and xpk restarts on the exit statuses the line names; for every TPU type both
            know, xpk's table (`UserFacingNameToSystemCharacteristics`) has the same topology, GKE
            accelerator label, nodes per slice and chips per node as `olmo_eqx.infra.manifests`.
  skypilot  every written task parses with `sky.Task.from_yaml` (no cloud needed), with the run
            command, one node, the TPU accelerator and the recovery setting written.
Exit status: 0 when every check that ran passed (a tool not found is said, and fails only with
--require), 1 otherwise.
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from olmo_eqx.infra.manifests import TPU_TYPES, Launch, render, tpu_type

OVERRIDES = ("+stage=pretrain", "+recipe=olmo3_7b_stage1", "trainer.micro_batches=8", "+note='a; $HOME'")
CASES = [("v5p-256", 2), ("v5litepod-16", 1), ("v6e-32", 4), ("v5p-8", 1)]
SKY_CASES = ["v5litepod-16", "v6e-32", "v5p-256", "v4-16", "v5litepod-8"]

# Run by the tool's own interpreter: JSON on stdin, one line of JSON out.
XPK_CHECK = r"""
import argparse, json, sys
from xpk.parser.core import set_parser
from xpk.commands.workload import get_restart_exit_codes
from xpk.core.system_characteristics import UserFacingNameToSystemCharacteristics as table
job = json.load(sys.stdin)
problems, checked = [], 0
for case in job["lines"]:
    parser = argparse.ArgumentParser(prog="xpk")
    set_parser(parser=parser)
    try:
        args = parser.parse_args(case["argv"][1:])
    except SystemExit:
        problems.append(f"xpk's parser refused: {case['argv']}")
        continue
    got = {"command": args.command, "tpu_type": args.tpu_type, "num_slices": args.num_slices,
           "docker_image": args.docker_image, "workload": args.workload, "cluster": args.cluster,
           "max_restarts": str(args.max_restarts)}
    for key, want in case["expect"].items():
        if got[key] != want:
            problems.append(f"{case['argv'][:8]}: xpk read {key}={got[key]!r}, written {want!r}")
    codes = set(get_restart_exit_codes(args))
    if not set(case["restart_on"]) <= codes:
        problems.append(f"xpk restarts on {sorted(codes)[:5]}..., not on {case['restart_on']}")
    checked += 1
rows, missing = 0, []
for name, ours in job["types"].items():
    if name not in table:
        missing.append(name)
        continue
    s = table[name]
    theirs = {"topology": s.topology, "gke_accelerator": s.gke_accelerator, "nodes": s.vms_per_slice, "chips_per_node": s.chips_per_vm}
    if theirs != ours:
        problems.append(f"{name}: xpk's table {theirs}, ours {ours}")
    rows += 1
print(json.dumps({"problems": problems, "lines": checked, "types": rows, "not_in_xpk": missing}))
"""

SKY_CHECK = r"""
import json, shlex, sys
import sky
job = json.load(sys.stdin)
problems = []
for case in job["tasks"]:
    task = sky.Task.from_yaml(case["path"])
    (resources,) = list(task.resources)
    if shlex.split(task.run) != case["argv"]:
        problems.append(f"{case['path']}: run {task.run!r}")
    if task.num_nodes != 1:
        problems.append(f"{case['path']}: num_nodes {task.num_nodes}")
    if resources.accelerators != {case["accelerator"]: 1}:
        problems.append(f"{case['path']}: accelerators {resources.accelerators}")
    recovery = getattr(resources, "job_recovery", None)
    if not recovery or recovery.get("max_restarts_on_errors") != case["restarts"]:
        problems.append(f"{case['path']}: job_recovery {recovery}")
print(json.dumps({"problems": problems, "tasks": len(job["tasks"]), "version": sky.__version__}))
"""


def has_module(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def run_check(python: str, program: str, job: dict) -> dict:
    done = subprocess.run([python, "-c", program], input=json.dumps(job), capture_output=True, text=True)
    if done.returncode != 0:
        return {"problems": [f"the check failed to run ({python}): {done.stderr.strip().splitlines()[-1:]}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def xpk_job() -> dict:
    lines = []
    for name, slices in CASES:
        launch = Launch(name="olmo7b", tpu=tpu_type(name), overrides=OVERRIDES, checkpoint_dir="gs://b/runs/olmo7b",
                        slices=slices, image="us-docker.pkg.dev/p/r/olmo_eqx:1", max_restarts=4)
        argv = shlex.split(render("xpk", launch, cluster="my-cluster", zone="us-east5-a"))
        lines.append({
            "argv": argv,
            "expect": {"command": launch.shell_command(), "tpu_type": name, "num_slices": slices,
                       "docker_image": launch.image, "workload": "olmo7b", "cluster": "my-cluster", "max_restarts": "4"},
            "restart_on": [1, 2],
        })
    types = {t.name: {"topology": t.topology, "gke_accelerator": t.gke_accelerator, "nodes": t.gke_nodes,
                      "chips_per_node": t.chips_per_gke_node} for t in TPU_TYPES.values()}
    return {"lines": lines, "types": types}


def sky_job(directory: Path) -> dict:
    tasks = []
    for name in SKY_CASES:
        launch = Launch(name="olmo7b", tpu=tpu_type(name), overrides=OVERRIDES, checkpoint_dir="gs://b/runs/olmo7b",
                        max_restarts=2)
        path = directory / f"sky-{name}.yaml"
        path.write_text(render("skypilot", launch))
        tasks.append({"path": str(path), "argv": launch.argv(), "accelerator": f"tpu-{name}", "restarts": 2})
    return {"tasks": tasks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--xpk-python", default=sys.executable, help="an interpreter with xpk installed")
    p.add_argument("--sky-python", default=sys.executable, help="an interpreter with skypilot installed")
    p.add_argument("--keep", help="write the SkyPilot tasks here (default: a temporary dir)")
    p.add_argument("--require", action="store_true", help="fail when a tool is not found")
    args = p.parse_args()

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.keep or tmp)
        directory.mkdir(parents=True, exist_ok=True)
        for tool, module, python, program, job in (
            ("xpk", "xpk", args.xpk_python, XPK_CHECK, xpk_job),
            ("skypilot", "sky", args.sky_python, SKY_CHECK, lambda: sky_job(directory)),
        ):
            if not has_module(python, module):
                print(f"{tool}: not checked ({module} does not import in {python}; see this script's docstring)")
                failed |= args.require
                continue
            result = run_check(python, program, job())
            for problem in result["problems"]:
                print(f"{tool}: FAIL {problem}")
            failed |= bool(result["problems"])
            summary = {k: v for k, v in result.items() if k != "problems"}
            print(f"{tool}: {'ok' if not result['problems'] else 'FAILED'} {json.dumps(summary)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
