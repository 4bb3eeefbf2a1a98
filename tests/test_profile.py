"""Reading a step's profile (olmo_eqx.train.profile): which op is what in the model, from the
compiled HLO's stack-frame tables, and the time per category."""

import importlib.util
import sys

import jax
import jax.numpy as jnp

from olmo_eqx.train.profile import format_profile, leaf_op_names, op_categories, op_table, time_by_category


def _module(path, name: str, source: str):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_ops_are_named_by_the_file_that_made_them(tmp_path):
    # A "model" whose norm is elementwise and whose head matmul is called from a file named
    # loss.py: the head's matmuls are loss/head, the norm's work elementwise, a scan a container.
    (tmp_path / "pkg").mkdir()
    model = _module(tmp_path / "pkg" / "olmo3.py", "profiled_model", "import jax.numpy as jnp\n"
                    "def dense(x, w):\n    return x @ w\n"
                    "def norm(x):\n    return x * jnp.tanh(x)\n")
    loss = _module(tmp_path / "pkg" / "loss.py", "profiled_loss", "import jax.numpy as jnp\n"
                   "def head_loss(dense, h, w):\n    return jnp.sum(dense(h, w) ** 2)\n")

    def step(x, w, v):
        h, _ = jax.lax.scan(lambda c, _: (model.norm(model.dense(c, v)), None), x, None, length=2)
        return loss.head_loss(model.dense, h, w)

    args = (jnp.ones((16, 8)), jnp.ones((8, 32)), jnp.ones((8, 8)))
    hlo = jax.jit(jax.grad(step, argnums=(1, 2))).lower(*args).compile().as_text()
    categories = op_categories(hlo)
    leaves = leaf_op_names(hlo)
    kinds = {category for name, (category, _) in categories.items() if name in leaves}
    assert "loss/head" in kinds and "projections" in kinds
    head_ops = [where for name, (category, where) in categories.items() if category == "loss/head"]
    assert all(where.startswith("loss.py") for where in head_ops)
    loops = [line.split("=")[0].split()[-1].lstrip("%") for line in hlo.splitlines() if ") while(" in line]
    assert loops and not set(loops) & leaves  # a loop's event spans its body's: never counted

    # Time per category and the printed table: every op's time lands in one category.
    times = {name: 1000.0 * (i + 1) for i, name in enumerate(sorted(leaves))}
    by_category, _ = time_by_category(times, hlo)
    assert sum(by_category.values()) == sum(times.values())
    text = format_profile(times, hlo, steps=1, top=3)
    assert "loss/head" in text and text.count("\n") >= 5
    # The whole table behind the top ops: every op, slowest first, with its opcode and type.
    table = op_table(times, hlo, steps=2)
    assert [row["op"] for row in table] == sorted(times, key=lambda name: -times[name])
    assert table[0]["ms_per_step"] == times[table[0]["op"]] / 2 / 1e6
    assert all(row["opcode"] and row["result"] for row in table)
    assert {row["category"] for row in table} == kinds


def test_a_kept_trace_reads_back_as_measured(tmp_path):
    # scripts/measure_step.py --profile on CPU (the suite's 8 fake devices) keeps its trace and compiled step; then
    # scripts/read_profile.py (the reader for any trainer's trace, MaxText's too) finds the
    # same ops with the same times in them.
    import json
    import os
    import subprocess
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()
    measured, read = tmp_path / "measured.json", tmp_path / "read.json"
    run = subprocess.run(
        [sys.executable, str(scripts / "measure_step.py"), "model=olmo3_tiny", "data.sequence_length=64",
         "data.global_batch_size=8", "--steps", "2", "--profile", "2", "--top", "3",
         "--keep-trace", str(tmp_path / "trace.xplane.pb.gz"), "--keep-hlo", str(tmp_path / "step.hlo.gz"),
         "--op-table", str(measured)],
        env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = subprocess.run(
        [sys.executable, str(scripts / "read_profile.py"), "--xplane", str(tmp_path / "trace.xplane.pb.gz"),
         "--hlo", str(tmp_path / "step.hlo.gz"), "--steps", "2", "--top", "3", "--table", str(read)],
        check=True, env=env, capture_output=True, text=True,
    )
    assert "by what the op is in the model:" in result.stdout and "top 3 ops:" in result.stdout
    want, got = json.loads(measured.read_text()), json.loads(read.read_text())
    assert want and got == want
    assert {"projections", "loss/head"} <= {row["category"] for row in got}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["measured.json", "read.json", "step.hlo.gz", "trace.xplane.pb.gz"]
    # A path that holds no trace is named, with exit status 2.
    missing = subprocess.run(
        [sys.executable, str(scripts / "read_profile.py"), "--xplane", str(tmp_path / "nothing"), "--hlo",
         str(tmp_path / "step.hlo.gz"), "--steps", "2"],
        env=env, capture_output=True, text=True,
    )
    assert missing.returncode == 2 and "nothing is neither a file nor a folder holding a .xplane.pb" in missing.stderr
