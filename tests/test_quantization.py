"""model.quantization=int8: the blocks' projections as Qwix int8 matmuls, forward and backward.

On CPU the integer matmuls run (slowly) as XLA:CPU's int8 dots, so the numerics are the ones a
TPU computes; the speed is the chip's to show (scripts/measure_step.py, docs/performance.md).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo_eqx.config import compose_config
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.quantization import quantized_matmul
from olmo_eqx.models.registry import build_model, with_config


def _relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_an_int8_matmul_is_close_to_the_float_one_forward_and_backward():
    x = jax.random.normal(jax.random.key(0), (256, 128), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (128, 96), jnp.float32) * 0.02
    cotangent = jax.random.normal(jax.random.key(2), (256, 96), jnp.float32)

    def pulled(matmul):
        out, vjp = jax.vjp(matmul, x, w)
        return out, *vjp(cotangent)

    exact = pulled(lambda x, w: x @ w)
    int8 = pulled(lambda x, w: quantized_matmul(x, w, "int8"))
    # Per-channel int8 keeps about 2 decimal digits of each operand: ~1% on the product.
    for got, want in zip(int8, exact):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert 1e-4 < _relative_error(got, want) < 0.03  # quantized (not exact), and close
    # [batch, seq, d] (dense's form when the sequence is sharded) scales per token as the flat form does.
    batched = quantized_matmul(x.reshape(4, 64, 128), w, "int8")
    np.testing.assert_allclose(batched.reshape(256, 96), int8[0], rtol=1e-6, atol=1e-6)


def test_the_quantized_program_multiplies_int8_operands():
    config = ModelConfig(compute_dtype="bfloat16", quantization="int8", n_layers=4)
    model = build_model(config, key=jax.random.key(0))
    tokens = jnp.zeros((2, 32), jnp.int32)

    def loss(model):
        return model(tokens).astype(jnp.float32).mean()

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    hlo = grad.lower(model).as_text()
    # 7 projections x 4 layers x 3 matmuls (forward, and the two of the backward).
    int8_dots = [line for line in hlo.splitlines() if "dot_general" in line and "xi8>" in line]
    assert len(int8_dots) >= 7 * 4 * 3, len(int8_dots)
    plain = ModelConfig(compute_dtype="bfloat16", n_layers=4)
    plain_hlo = grad.lower(with_config(model, quantization=None)).as_text()
    assert plain == dataclasses.replace(config, quantization=None)
    assert not [line for line in plain_hlo.splitlines() if "dot_general" in line and "xi8>" in line]


@pytest.mark.parametrize("architecture", ["olmo", "olmoe"])
def test_other_architectures_quantize_their_attention_projections(architecture):
    overrides = {"olmo": dict(sliding_window=None, architecture="olmo"),
                 "olmoe": dict(sliding_window=None, architecture="olmoe", n_experts=4, n_experts_per_token=2)}
    config = ModelConfig(compute_dtype="bfloat16", quantization="int8", **overrides[architecture])
    model = build_model(config, key=jax.random.key(0))
    hlo = jax.jit(lambda m: m(jnp.zeros((1, 16), jnp.int32))).lower(model).as_text()
    assert "xi8>" in hlo


def test_int8_training_follows_the_bf16_loss(tmp_path):
    """30 steps of the tiny model on the embedded data: int8's loss stays within 2% of bf16's
    at every step (the chip's 200-step run of olmo3_190m: docs/performance.md)."""
    from olmo_eqx.data.sources import build_datasets
    from olmo_eqx.data.loader import DataLoader, global_batch_arrays
    from olmo_eqx.sharding import ShardingRules, batch_sharding, make_mesh
    from olmo_eqx.train.schedules import make_schedule
    from olmo_eqx.train.state import init_train_state
    from olmo_eqx.train.step import make_train_step

    base = compose_config(["model.compute_dtype=bfloat16", "data.global_batch_size=8", "data.sequence_length=64",
                           "trainer.steps=30", "optim.lr=3e-3"])
    dataset, _ = build_datasets(base.data, base.model.vocab_size)
    mesh = make_mesh(base.mesh)
    rules = ShardingRules()
    schedule = make_schedule(base.schedule, base.optim.lr, base.trainer.steps)
    losses = {}
    for quantization in (None, "int8"):
        model_config = dataclasses.replace(base.model, quantization=quantization)
        state = init_train_state(model_config, base.optim, mesh, rules, jax.random.key(0))
        step = make_train_step(base.optim, schedule, mesh=mesh, rules=rules)
        loader = DataLoader(dataset, base.data.global_batch_size, base.data.seed)
        curve = []
        for _ in range(base.trainer.steps):
            batch = global_batch_arrays(loader.next_batch(), batch_sharding(mesh, rules))
            state, metrics = step(state, batch)
            curve.append(float(metrics["loss"]))
        losses[quantization] = np.array(curve)
    bf16, int8 = losses[None], losses["int8"]
    assert bf16[-1] < bf16[0] - 0.5  # it trains
    assert np.max(np.abs(int8 - bf16) / bf16) < 0.02, (bf16.round(3).tolist(), int8.round(3).tolist())
    assert not np.array_equal(int8, bf16)  # the matmuls were quantized


def test_a_missing_qwix_is_one_clear_error(monkeypatch):
    import builtins

    import olmo_eqx.models.quantization as quantization

    real_import = builtins.__import__

    def no_qwix(name, *args, **kwargs):
        if name.startswith("qwix"):
            raise ModuleNotFoundError("No module named 'qwix'")
        return real_import(name, *args, **kwargs)

    quantization._qwix_int8.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_qwix)
    try:
        with pytest.raises(quantization.QuantizationUnavailable, match=r"pip install -c constraints.txt -e '\.\[int8\]'"):
            quantization.check_available("int8")
    finally:
        monkeypatch.undo()
        quantization._qwix_int8.cache_clear()


def test_the_curve_script_trains_both_arms_from_one_start_and_reports_the_gap(tmp_path, capsys):
    """scripts/quantization_curve.py (issue 52's 200-step bf16/int8 curve, docs/performance.md)
    in 3 steps of the nano model: both arms run the pretrain stage, and the table, the final gap
    and the JSON come from the same curves."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "quantization_curve.py"
    spec = importlib.util.spec_from_file_location("quantization_curve", path)
    curve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curve)
    # The quantization is the script's to vary; the default size applies unless a model is named.
    with pytest.raises(SystemExit):
        curve.parse_args(["model.quantization=int8"])
    default = curve.overrides_for(200, [], "null")
    assert "model.d_model=256" in default and "schedule.warmup_steps=20" in default
    assert default[-1] == "model.quantization=null"

    curve.main(["--steps", "3", "--json", str(tmp_path / "curve.json"),
                "model=olmo3_nano", "data.sequence_length=32", "trainer.eval_batches=1"])
    result = json.loads((tmp_path / "curve.json").read_text())
    assert "model.d_model=256" not in result["overrides"]["int8"]
    assert result["overrides"]["int8"][-1] == "model.quantization=int8"
    bf16, int8 = result["arms"]["bf16"]["loss"], result["arms"]["int8"]["loss"]
    assert len(bf16) == len(int8) == 3
    assert bf16 != int8 and abs(int8[0] - bf16[0]) / bf16[0] < 0.01  # one start, quantized matmuls
    assert [row["step"] for row in result["table"]] == [1, 3]
    assert result["final"]["gap"] == pytest.approx((sum(int8) - sum(bf16)) / sum(bf16))
    assert "mean train loss of the last 3 steps" in capsys.readouterr().out
