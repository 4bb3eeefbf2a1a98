"""Context parallelism: the sequence split over a "context" mesh axis gives the same loss and
gradients as no split (float32), with sliding windows and document masking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from olmo_eqx.batch import TokenBatch, document_layout
from olmo_eqx.models.config import ModelConfig
from olmo_eqx.models.base import unconstrained
from olmo_eqx.models.olmo3 import OLMo
from olmo_eqx.sharding import ActivationSharding, MeshConfig, make_mesh
from olmo_eqx.train.step import model_loss_sums

CONFIG = ModelConfig(
    d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128,
    vocab_size=256, padded_vocab_size=256, sliding_window=12,
)
BATCH, SEQ, EOS = 4, 64, 255


def make_batch(documents: bool) -> TokenBatch:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, EOS, size=(BATCH, SEQ)).astype(np.int32)
    ids[rng.random((BATCH, SEQ)) < 0.08] = EOS  # documents of varied lengths, some crossing shards
    segment_ids = positions = None
    if documents:
        segment_ids, positions = document_layout(ids, EOS, reset_positions=True)
    mask = np.ones((BATCH, SEQ), np.float32)
    as_jnp = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    return TokenBatch(jnp.asarray(ids), jnp.asarray(mask), as_jnp(segment_ids), as_jnp(positions))


def loss_and_grads(model, batch, constrain):
    def loss(model):
        sums = model_loss_sums(model, batch, constrain)
        return sums.ce / sums.count

    return jax.jit(jax.value_and_grad(loss))(model)


@pytest.fixture(scope="module")
def model():
    return OLMo(CONFIG, key=jax.random.key(0))


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
@pytest.mark.parametrize("mesh_config", [MeshConfig(fsdp=4, context=2), MeshConfig(fsdp=1, context=8)], ids=["fsdp4-context2", "context8"])
def test_context_parallel_equals_unsplit(model, documents, mesh_config):
    batch = make_batch(documents)
    base_loss, base_grads = loss_and_grads(model, batch, unconstrained)
    mesh = make_mesh(mesh_config)
    assert ActivationSharding(mesh).spec((BATCH, SEQ, 4, 16), ("batch", "sequence", "act_heads", "head_dim"))[1] == "context"
    layout = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    split = jax.tree.map(lambda x: jax.device_put(x, layout), batch)
    loss, grads = loss_and_grads(model, split, ActivationSharding(mesh))
    assert abs(float(loss) - float(base_loss)) <= 1e-6 * abs(float(base_loss))
    for g, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
        g, b = np.asarray(g), np.asarray(b)
        assert np.linalg.norm(g - b) <= 1e-5 * np.linalg.norm(b)
