"""The zoo, shape checking, FLOPs, attention paths and HF checkpoint errors."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import TypeCheckError
from safetensors.flax import load_file, save_file

from olmo_eqx import OLMo, ZOO, count_params, flops_per_token, get_model_config, load_hf, save_hf, with_config
from olmo_eqx.interop.hf import HFCheckpointError
from olmo_eqx.models.base import logical_axes


@pytest.fixture(scope="module")
def tiny() -> OLMo:
    return OLMo(get_model_config("olmo3_tiny_gqa", vocab_size=300, padded_vocab_size=384), key=jax.random.key(1))


@pytest.mark.parametrize(
    "name, padded, expected",
    [
        ("olmo3_7b", 100_352, 7_298_617_344),
        ("olmo3_7b", 100_278, 7_298_011_136),
        ("olmo3_32b", 100_352, 32_234_279_936),
        ("olmo3_32b", 100_278, 32_233_522_176),
    ],
)
def test_zoo_parameter_counts(name, padded, expected):
    assert count_params(get_model_config(name, padded_vocab_size=padded)) == expected


def test_zoo_is_olmo_shaped():
    olmo3_7b = ZOO["olmo3_7b"]
    assert olmo3_7b.layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"]
    assert (olmo3_7b.sliding_window, olmo3_7b.mlp_hidden, olmo3_7b.n_kv_heads) == (4096, 11008, 32)
    assert (ZOO["olmo3_32b"].n_kv_heads, ZOO["olmo3_32b"].mlp_hidden) == (8, 27648)
    assert all(t == "full_attention" for t in ZOO["olmo2_13b"].layer_types)
    ladder = [count_params(ZOO[f"olmo3_{size}"]) for size in ("30m", "60m", "100m", "190m", "370m", "760m", "1b")]
    assert ladder == sorted(ladder) and ladder[0] < 1e8 and 1e9 < ladder[-1] < 2e9
    with pytest.raises(KeyError, match="olmo3_7b"):
        get_model_config("olmo3_7B_typo")


def test_flops_per_token_counts_sliding_layers_with_their_window():
    config = ZOO["olmo3_7b"]
    seq = 8192
    attention = 12 * 32 * 128 * (8 * seq + 24 * 4096)  # 8 full layers, 24 sliding ones
    n_matmul = count_params(config) - config.padded_vocab_size * config.d_model - (4 * 4096 * 32 + 4096)
    assert flops_per_token(config, seq) == 6 * n_matmul + attention
    # At or below the window, sliding layers cost the same as full ones.
    assert flops_per_token(config, 4096) == flops_per_token(ZOO["olmo2_7b"], 4096)


def test_wrong_shape_is_a_clear_error(tiny):
    with pytest.raises(TypeCheckError, match="batch seq"):
        tiny(jnp.zeros((12,), jnp.int32))
    tokens = jnp.zeros((2, 12), jnp.int32)
    with pytest.raises(TypeCheckError, match="seq"):
        tiny(tokens, positions=jnp.zeros((2, 13), jnp.int32))


def test_fast_attention_matches_reference_and_window_matters(tiny):
    tokens = jax.random.randint(jax.random.key(0), (2, 3 * tiny.config.sliding_window), 0, 300)
    fast = eqx.filter_jit(lambda m, t: m(t))
    xla = fast(tiny, tokens)
    reference = fast(with_config(tiny, attention_impl="reference"), tokens)
    np.testing.assert_allclose(np.asarray(xla), np.asarray(reference), atol=1e-5, rtol=1e-5)
    no_window = fast(with_config(tiny, sliding_window=None), tokens)
    assert float(jnp.abs(no_window - xla).max()) > 1e-3
    # Within the window, sliding and full attention agree exactly on the first positions.
    first = tiny.config.sliding_window
    np.testing.assert_allclose(np.asarray(no_window[:, :first]), np.asarray(xla[:, :first]), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rope_by_matmul_is_rope_by_slices(dtype):
    # The TPU's rotate-half (a signed-permutation matmul, olmo3.ROTATE_BY_MATMUL_ON) against the
    # sliced form every other platform runs: eagerly the same bits, forward and gradient.
    from olmo_eqx.models.olmo3 import Rope

    config = get_model_config("olmo3_600m")  # head_dim 80: halves of 40 columns
    positions = jnp.arange(96)[None]
    sliced, by_matmul = (Rope(positions, config, yarn=False, platform=p) for p in ("cpu", "tpu"))
    assert by_matmul.by_matmul and not sliced.by_matmul
    x = (3 * jax.random.normal(jax.random.key(0), (2, 96, 3, config.head_dim))).astype(dtype)
    weights = jax.random.normal(jax.random.key(1), x.shape).astype(dtype)
    assert jnp.array_equal(sliced(x), by_matmul(x))
    assert not jnp.array_equal(sliced(x), x)  # it rotates something
    grads = [jax.grad(lambda x: jnp.sum((rope(x) * weights).astype(jnp.float32)))(x) for rope in (sliced, by_matmul)]
    assert grads[1].dtype == dtype and jnp.array_equal(*grads)


def test_logits_cover_the_real_vocab_only(tiny):
    logits = tiny(jnp.zeros((1, 4), jnp.int32))
    assert logits.shape == (1, 4, 300) and logits.dtype == jnp.float32


def test_logical_axes_name_every_dimension(tiny):
    axes = logical_axes(tiny)
    for leaf, names in zip(jax.tree.leaves(tiny), jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert len(names) == leaf.ndim
    assert axes.blocks.attention.q_proj == ("layers", "embed", "heads")
    assert axes.embed == ("vocab", "embed")


def test_sharded_save_and_load_roundtrip(tiny, tmp_path):
    save_hf(tiny, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    again = load_hf(tmp_path, padded_vocab_size=384)
    assert again.config.replace(name=tiny.config.name) == tiny.config
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(tiny)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape[0] == 384 or a.shape[-1] == 384:  # padding rows come back as zeros
            a, b = a[..., :300] if a.shape[-1] == 384 else a[:300], b[..., :300] if b.shape[-1] == 384 else b[:300]
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def saved(tiny, tmp_path):
    save_hf(tiny, tmp_path)
    return tmp_path


def _edit_weights(directory, edit):
    tensors = dict(load_file(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def test_missing_tensor_is_named(saved):
    _edit_weights(saved, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*missing"):
        load_hf(saved)


def test_extra_tensor_is_named(saved):
    _edit_weights(saved, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": jnp.zeros(128)}))
    with pytest.raises(HFCheckpointError, match=r"q_proj\.bias"):
        load_hf(saved)


def test_wrong_shape_tensor_is_named(saved):
    _edit_weights(saved, lambda t: t.update({"model.norm.weight": jnp.ones(7)}))
    with pytest.raises(HFCheckpointError, match=r"model\.norm\.weight.*shape \(7,\)"):
        load_hf(saved)


def test_other_architecture_is_refused(saved):
    config = json.loads((saved / "config.json").read_text())
    config["model_type"] = "llama"
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match="model_type='llama'"):
        load_hf(saved)


def test_not_a_checkpoint_directory(tmp_path):
    with pytest.raises(HFCheckpointError, match="config.json"):
        load_hf(tmp_path)
