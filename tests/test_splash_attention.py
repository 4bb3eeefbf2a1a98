"""The splash-attention adapter against plain masked softmax, run on CPU in Pallas interpret mode.

Interpret mode executes the kernel's own blockwise numerics (online softmax, block skipping,
the custom backward kernels), so these check the adapter's conventions: scale, window
off-by-one, GQA head mapping, padding to the block size, and gradients.
"""

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import pytest

from olmo_eqx.models import splash
from olmo_eqx.models.splash import splash_attention

TOLERANCE = 1e-5  # max abs error relative to the max abs value of the reference


def masked_softmax_attention(q, k, v, sliding_window: Optional[int]):
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    query = jnp.arange(q.shape[1])[:, None]
    key = jnp.arange(k.shape[1])[None, :]
    allowed = key <= query
    if sliding_window is not None:
        allowed = allowed & (key > query - sliding_window)  # OLMo's window includes the query
    probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _inputs(seq: int, heads: int, kv_heads: int, head_dim: int = 64, batch: int = 2):
    kq, kk, kv, kout = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), jnp.float32)
    cotangent = jax.random.normal(kout, q.shape, jnp.float32)
    return q, k, v, cotangent


def _relative_error(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _forward_and_gradients(attention, q, k, v, cotangent):
    def run(q, k, v, cotangent):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, *vjp(cotangent)

    # One compiled program runs the interpreted kernel much faster than op-by-op dispatch.
    return jax.jit(run)(q, k, v, cotangent)


# seq is never a multiple of 128, so every case pads; 300 with block 128 pads to 3 blocks, where
# a 48-token window lets the kernel skip the (query block 2, key block 0) tile outright.
CASES = {
    "causal-gqa": dict(seq=200, heads=4, kv_heads=2, sliding_window=None, block_size=128),
    "window-gqa": dict(seq=300, heads=4, kv_heads=2, sliding_window=48, block_size=128),
    "window-mha": dict(seq=200, heads=2, kv_heads=2, sliding_window=48, block_size=128),
    # the default 512 block is clipped to the padded sequence (256)
    "wide-window": dict(seq=200, heads=4, kv_heads=2, sliding_window=1000, block_size=512),
    # 5 key blocks, causal: one fused backward kernel still (its dq copies are few bytes),
    # the examples run one at a time (lax.map)
    "five-blocks": dict(seq=600, heads=2, kv_heads=1, sliding_window=None, block_size=128),
    # 5 key blocks, sliding window: the backward's separate dq kernel
    "five-blocks-window": dict(seq=600, heads=2, kv_heads=1, sliding_window=200, block_size=128),
    # 6 blocks, causal: keys in 256-blocks (splash.key_block), fused backward
    "six-blocks-wide-keys": dict(seq=700, heads=2, kv_heads=1, sliding_window=None, block_size=128),
    # 6 blocks of 256, causal: keys in 512-blocks scored 128 at a time, fused backward
    "six-blocks-wide-keys-half-compute": dict(seq=1400, heads=2, kv_heads=1, sliding_window=None, block_size=256),
    # 5 blocks of 256, sliding window: the forward scores 128 keys at a time
    "five-blocks-window-half-compute": dict(seq=1200, heads=2, kv_heads=1, sliding_window=300, block_size=256),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_forward_and_gradients_match_masked_softmax(case):
    q, k, v, cotangent = _inputs(case["seq"], case["heads"], case["kv_heads"])
    window = case["sliding_window"]
    kernel = functools.partial(
        splash_attention, sliding_window=window, interpret=True, block_size=case["block_size"]
    )
    reference = functools.partial(masked_softmax_attention, sliding_window=window)
    got = _forward_and_gradients(kernel, q, k, v, cotangent)
    want = _forward_and_gradients(reference, q, k, v, cotangent)
    names = ("out", "dq", "dk", "dv")
    errors = {name: _relative_error(g, w) for name, g, w in zip(names, got, want)}
    print(errors)
    assert got[0].shape == q.shape
    assert all(e <= TOLERANCE for e in errors.values()), errors


def test_window_of_one_sees_only_the_query_token():
    # The sharpest off-by-one check: W=1 must return each query head's own-position value.
    q, k, v, _ = _inputs(seq=130, heads=4, kv_heads=2, batch=1)
    attend = functools.partial(splash_attention, sliding_window=1, interpret=True, block_size=128)
    out = jax.jit(attend)(q, k, v)
    assert _relative_error(out, jnp.repeat(v, 2, axis=2)) <= TOLERANCE


def test_kernel_built_inside_a_trace_is_reusable_by_the_next_trace():
    # The kernel cache is filled from inside jit; a cached tracer would break the second trace.
    splash._kernel.cache_clear()
    q, k, v, _ = _inputs(seq=130, heads=2, kv_heads=1, batch=1)
    attend = functools.partial(splash_attention, sliding_window=40, interpret=True, block_size=128)
    first = jax.jit(attend)(q, k, v)
    second = jax.jit(lambda q, k, v: attend(q, k, v) + 0.0)(q, k, v)
    assert splash._kernel.cache_info().hits >= 1
    assert _relative_error(second, first) == 0.0


def test_splash_through_attend_on_an_eight_device_mesh():
    """Under a mesh, `attend` runs the (unpartitionable) kernel once per batch shard."""
    from olmo_eqx.models.attention import AttentionMask, attend, reference_attention
    from olmo_eqx.sharding import ActivationSharding, MeshConfig, make_mesh

    constrain = ActivationSharding(make_mesh(MeshConfig()))
    q, k, v = (jax.random.normal(key, (8, 130, 4, 64)) for key in jax.random.split(jax.random.key(5), 3))
    run = jax.jit(lambda q, k, v: attend(q, k, v, AttentionMask(48), implementation="splash", constrain=constrain))
    got = run(q, k, v)
    want = reference_attention(q, k, v, AttentionMask(48))
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= 1e-5


def _documents(batch: int, seq: int) -> jax.Array:
    """Segment ids of packed documents: non-decreasing, a different split on every row."""
    cuts = jnp.array([[seq // 3, seq // 2], [seq // 5, 4 * seq // 5]])[:batch]
    return jnp.sum(jnp.arange(seq)[None, None, :] >= cuts[:, :, None], axis=1).astype(jnp.int32)


def test_splash_with_documents_and_context_parallelism_equals_the_reference():
    """Document masking (segment ids) through the kernel, on one device and with the sequence
    split over a mesh axis (splash under shard_map, K/V gathered): forward and gradients."""
    from olmo_eqx.models.attention import AttentionMask, attend, reference_attention
    from olmo_eqx.sharding import ActivationSharding, MeshConfig, make_mesh

    q, k, v, cotangent = _inputs(seq=256, heads=4, kv_heads=2, head_dim=64)
    mask = AttentionMask(48, _documents(2, 256))
    want = _forward_and_gradients(lambda q, k, v: reference_attention(q, k, v, mask), q, k, v, cotangent)
    one = functools.partial(splash_attention, sliding_window=48, segment_ids=mask.segment_ids, interpret=True, block_size=128)
    context = ActivationSharding(make_mesh(MeshConfig(data=2, fsdp=1, context=2, tensor=2), jax.devices()))
    split = lambda q, k, v: attend(q, k, v, mask, implementation="splash", constrain=context, block_size=128)  # noqa: E731
    for attention in (one, split):
        got = _forward_and_gradients(attention, q, k, v, cotangent)
        for g, w in zip(got, want):
            assert _relative_error(g, w) <= TOLERANCE


def test_a_policy_keeping_the_context_keeps_the_kernels_residuals(capsys):
    """The kernel names its output and log-sum-exp like the context (`splash.RESIDUAL_NAME`):
    a remat policy that keeps the context keeps both, so the backward pass needs no second run
    of the forward kernel; `full` keeps neither."""
    q, k, v = (jax.random.normal(key, (1, 256, 2, 64)) for key in jax.random.split(jax.random.PRNGKey(0), 3))

    def saved(policy) -> str:
        loss = lambda q, k, v: jnp.sum(jnp.sin(splash_attention(q, k, v, sliding_window=None, block_size=128)))  # noqa: E731
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), q, k, v)
        return capsys.readouterr().out

    kept = saved(jax.checkpoint_policies.save_only_these_names(splash.RESIDUAL_NAME))
    assert "f32[1,2,256,64] output of jitted function '_splash_attention'" in kept  # the output, heads major
    assert "f32[1,2,256] output of jitted function '_splash_attention'" in kept  # the log-sum-exp
    assert "_splash_attention" not in saved(None)


def test_attend_keeps_one_copy_of_the_context(capsys):
    """`attend` names the context a remat policy keeps (attention.CONTEXT_NAME), but not after
    splash, whose kernel already names its output (the same context, heads-major): both kept
    cost olmo3_600m 2.7 GB at 2 x 32,768 tokens, and its `save_context` no longer fit a v5e."""
    from olmo_eqx.models.attention import CONTEXT_NAME, AttentionMask, attend

    q, k, v = (jax.random.normal(key, (1, 256, 2, 64)) for key in jax.random.split(jax.random.PRNGKey(0), 3))

    def saved(implementation: str) -> list[str]:
        context = functools.partial(attend, mask=AttentionMask(None), implementation=implementation, block_size=128)
        loss = lambda q, k, v: jnp.sum(jnp.sin(context(q, k, v)))  # noqa: E731
        policy = jax.checkpoint_policies.save_only_these_names(CONTEXT_NAME)
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), q, k, v)
        return [line for line in capsys.readouterr().out.splitlines() if "from the argument" not in line and "constant" not in line]

    kernel = saved("splash")
    assert [line.split(" ")[0] for line in kernel] == ["f32[1,2,256,64]", "f32[1,2,256]"]  # output and log-sum-exp
    assert all("_splash_attention" in line for line in kernel)
    blockwise = saved("blockwise")
    assert len(blockwise) == 1 and blockwise[0].startswith(f"f32[1,256,2,64] named '{CONTEXT_NAME}'")

    # The same through a model's layers under `save_context`: per layer the kernel's two, and
    # no context in the model's [batch, seq, heads, head_dim] layout.
    import equinox as eqx

    from olmo_eqx import OLMo, get_model_config

    config = get_model_config("olmo3_tiny_gqa", vocab_size=300, padded_vocab_size=384, attention_impl="splash",
                              remat="save_context", attention_block_size=128)
    params, static = eqx.partition(OLMo(config, key=jax.random.key(0)), eqx.is_inexact_array)
    tokens = jnp.zeros((1, 256), jnp.int32)
    jax.ad_checkpoint.print_saved_residuals(lambda p: jnp.sum(eqx.combine(p, static)(tokens)), params)
    residuals = capsys.readouterr().out
    assert residuals.count("output of jitted function '_splash_attention'") == 2 * config.n_layers
    assert f"named '{CONTEXT_NAME}'" not in residuals

    # remat_sliding=full: only the full-attention layers (1 in 4) keep theirs.
    mixed = eqx.combine(params, static).__class__(config.replace(remat_sliding="full"), key=jax.random.key(0))
    params, static = eqx.partition(mixed, eqx.is_inexact_array)
    jax.ad_checkpoint.print_saved_residuals(lambda p: jnp.sum(eqx.combine(p, static)(tokens)), params)
    full_layers = sum(not config.is_sliding(layer) for layer in range(config.n_layers))
    assert full_layers == config.n_layers // 4
    assert capsys.readouterr().out.count("output of jitted function '_splash_attention'") == 2 * full_layers


def test_the_backward_is_one_fused_kernel_only_while_its_partial_dq_copies_are_few():
    """The fused backward holds one partial dq per key block: past 4 key blocks only a causal
    layer whose copies stay under FUSED_BACKWARD_MAX_DQ_BYTES keeps it; a sliding-window
    layer keeps the separate dq kernel."""
    def fused(seq, heads=2, window=None, head_dim=64):
        kernel = splash._kernel(seq, heads, window, 128, True, head_dim=head_dim)
        return kernel.tree_flatten()[1]["block_sizes"].use_fused_bwd_kernel

    short = 128 * splash.FUSED_BACKWARD_MAX_KEY_BLOCKS
    assert fused(short) and fused(short, window=100)
    assert fused(short + 128) and not fused(short + 128, window=100)
    # What the planner's estimate asks, as splash_attention pads and blocks a sequence: OLMo
    # 3's 4096 tokens in 1024-token blocks fuse; 32,768 tokens fuse on olmo3_190m's causal
    # layers (12 heads of 64, 2048-token key blocks: 16 copies of 12 x 32768 x 128 lanes in
    # bf16, 1.5 GiB), not on olmo3_600m's all at once (16 heads: 2 GiB; it splits them,
    # head_groups) nor on any sliding-window layer; nor 65,536 tokens.
    fuses = functools.partial(splash.fused_backward, block_size=1024)
    assert fuses(4096) and fuses(4096, heads=16, head_dim=80, sliding_window=4096)
    assert fuses(32768, heads=12, head_dim=64) and not fuses(32768, heads=12, head_dim=64, sliding_window=4096)
    assert not fuses(32768, heads=16, head_dim=80) and not fuses(65536, heads=12, head_dim=64)
    assert splash.fused_backward(300, 1024) and not splash.fused_backward(4096, 512)  # key blocks only


def test_a_long_causal_layer_too_wide_to_fuse_runs_its_heads_in_groups_that_fuse(monkeypatch):
    """Where all heads' partial dq copies pass FUSED_BACKWARD_MAX_DQ_BYTES, the fewest groups of
    whole kv heads whose copies stay under it run one at a time, each with the fused backward:
    same outputs and gradients as the masked-softmax reference (GQA heads kept with their kv
    head), and with documents the same as all heads at once."""
    # olmo3_600m's full layers at 2 x 32,768 (16 heads of 80): 2 groups of 8; olmo3_190m's
    # (12 of 64) fuse whole; a sliding-window layer and a short sequence are never split.
    assert splash.head_groups(32768, 1024, 16, 16, head_dim=80) == 2
    assert splash.fused_backward(32768, 1024, heads=8, head_dim=80)
    assert splash.head_groups(32768, 1024, 12, 12, head_dim=64) == 1
    assert splash.head_groups(32768, 1024, 16, 16, head_dim=80, sliding_window=4096) == 1
    assert splash.head_groups(4096, 1024, 16, 16, head_dim=80) == 1

    q, k, v, cotangent = _inputs(700, heads=4, kv_heads=2)  # 768 tokens: 3 key blocks of 256
    one_group = 3 * 4 * 768 * 128 * 2
    monkeypatch.setattr(splash, "FUSED_BACKWARD_MAX_DQ_BYTES", one_group // 2)
    splash._kernel.cache_clear()
    assert splash.head_groups(768, 128, 4, 2, head_dim=64) == 2
    kernel = functools.partial(splash_attention, sliding_window=None, interpret=True, block_size=128)
    got = _forward_and_gradients(kernel, q, k, v, cotangent)
    want = _forward_and_gradients(functools.partial(masked_softmax_attention, sliding_window=None), q, k, v, cotangent)
    errors = {name: _relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    assert all(e <= TOLERANCE for e in errors.values()), errors
    assert splash._kernel(768, 2, None, 128, True, head_dim=64).tree_flatten()[1]["block_sizes"].use_fused_bwd_kernel

    documents = jnp.concatenate([jnp.zeros((2, 300), jnp.int32), jnp.ones((2, 400), jnp.int32)], axis=1)
    with_documents = functools.partial(kernel, segment_ids=documents)
    grouped = _forward_and_gradients(with_documents, q, k, v, cotangent)
    monkeypatch.setattr(splash, "FUSED_BACKWARD_MAX_DQ_BYTES", one_group)
    splash._kernel.cache_clear()
    whole = _forward_and_gradients(with_documents, q, k, v, cotangent)
    splash._kernel.cache_clear()
    for g, w in zip(grouped, whole):
        assert _relative_error(g, w) <= TOLERANCE


def test_long_layers_take_wider_key_blocks_and_narrower_score_tiles():
    """Past 4 key blocks a causal layer's forward and dk/dv kernels take keys in blocks of
    twice the size, and every long layer's forward scores half a block of keys at a time;
    shorter sequences, and context parallelism's kernels, keep one block size throughout."""
    def sizes(seq, window=None, block=256, shards=1):
        return splash._kernel(seq, 2, window, block, True, shards, head_dim=64).tree_flatten()[1]["block_sizes"]

    causal, sliding, short = sizes(1536), sizes(1536, window=300), sizes(1024)
    assert (causal.block_q, causal.block_kv, causal.block_kv_compute, causal.block_kv_dkv) == (256, 512, 128, 512)
    assert (sliding.block_kv, sliding.block_kv_compute, sliding.block_kv_dkv) == (256, 128, 256)
    assert {short.block_kv, short.block_kv_compute, short.block_kv_dkv} == {256}
    assert sizes(1536, shards=2).block_kv == 256
    assert splash.key_block(1536, 256) == 512 and splash.key_block(1280, 256) == 256  # 5 blocks: not 2 whole ones
