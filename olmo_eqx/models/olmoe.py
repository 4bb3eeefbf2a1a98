"""OLMoE and FlexOlmo, the OLMo family's mixture-of-experts decoders, readable top to bottom.

    tokens -> embed -> [MoEBlock x n_layers] -> norm -> head

Both replace every layer's MLP by `n_experts` SwiGLU experts and a router that sends each token
to `n_experts_per_token` of them (softmax over the experts, then top-k; the chosen
probabilities renormalised only with `norm_topk_prob`). Attention is OLMo 3's (full-width
QK-norm over all heads together, RoPE, the kernels of `attention.py`) with full attention on
every layer. The two differ in where the norms sit (HF transformers' `modeling_olmoe.py` and
`modeling_flex_olmo.py`):

    OLMoE ("olmoe", pre-norm):                 FlexOlmo ("flex_olmo", OLMo 2's reordered norm):
    h   = x + attention(input_norm(x))         h   = x + attention_norm(attention(x))
    out = h + moe(mlp_input_norm(h))           out = h + mlp_norm(moe(h))

OLMoE may also clamp q, k, v to +-`clip_qkv` after the QK-norm (its released config does not).

Routing is *dropless*: every token reaches all of its k experts, whatever the load. The k
assignments of every token are sorted by expert and each expert's matmuls run over its
contiguous group (`jax.lax.ragged_dot`, a grouped matmul): no capacity factor, no padding to
the busiest expert, no dropped tokens, and the FLOPs of the k active experts only. `moe_impl:
dense` runs every expert on every token and masks the result: the reference the tests check
the dropless path against (E/k times the work).

The router's auxiliary losses, per layer and then averaged over layers:
  load balance  E * sum_e f_e * P_e  (f_e: fraction of the token->expert assignments that went
                to expert e, P_e: mean router probability of e; 1 when perfectly balanced;
                Switch Transformer's loss, as HF's `load_balancing_loss_func` but per layer)
  z-loss        mean over tokens of logsumexp(router logits)^2 (ST-MoE), keeps logits small
weighted by `router_aux_loss_coef` (0.01) and `router_z_loss_coef` (0.001), OLMoE's values. They
reach training through `hidden_states_and_aux`, with each layer's expert load as metrics.

Expert weights are stored [expert, in, out] with the logical axis "expert" first, so the
sharding rules can split the experts over a mesh axis. With an "expert" mesh axis of size P > 1
(`mesh.expert=P`, expert parallelism) each device holds E/P experts of every layer and
`expert_parallel` moves the tokens instead of the weights, under `shard_map`: every device
routes its own tokens, sends each assignment to the device holding its expert (all-to-all),
runs its local experts over what it received (grouped matmuls), and sends the results back
(all-to-all). The other mesh axes stay FSDP / data parallel (the expert weights' model
dimension is split over "fsdp" and gathered for the layer, like any FSDP weight). One device,
or no mesh, or "expert" of size 1: the plain `dropless` path.

All-to-all needs static shapes and XLA:CPU has no `ragged_all_to_all`, so the exchange is a
dense all-to-all of fixed per-peer slots, sized for the worst case to stay dropless: a token
sends at most min(k, E/P) assignments to one peer (its k experts are distinct), so a device
with T tokens gives each of the P peers C = T * min(k, E/P) rows. The cost of that guarantee:
send and receive buffers of P * C rows (P * min(k, E/P) / k times the T * k assignments),
and the same factor on the bytes moved, each way, every layer (OLMoE-1B-7B with P = 8: 8x;
docs/planning.md). The local grouped matmuls take the P * C received rows, about T * k of
them real on average: TPU and GPU multiply only the rows inside the groups, XLA:CPU's
`ragged_dot` every row by every local expert. `jax.lax.ragged_all_to_all`, which would move
only the real rows, is not implemented by XLA:CPU (this jax, 0.10.2), so nothing here could
test it. `moe_exchange: all_gather` trades the all-to-all for an all-gather of the expert
group's tokens and a reduce-scatter of the results: P * T rows each way, each token once
whatever its k, which is min(k, E/P) times fewer than the slots (OLMoE-1B-7B: 8x); every
device then sorts the P * T * k assignments of the group to find its own.
"""

from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .attention import AttentionMask, program_platform
from .base import AUX_OBJECTIVE, CausalLM, Constrain, embed_tokens, over_layers, unconstrained
from .base import axes as _axes
from .config import ModelConfig
from .olmo3 import _REMAT_POLICIES, HIDDEN, Attention, RMSNorm, Rope, _truncated_normal, dense, swiglu

MOE_ARCHITECTURES = ("olmoe", "flex_olmo")


# ---------------------------------------------------------------------------------------------
# Attention: OLMo 3's, behind an optional input norm, with optional clipping.


class MoEAttention(eqx.Module):
    """OLMo 3's attention weights and kernels; OLMoE puts its pre-norm in front (`input_norm`).

    Keeping the pre-norm inside the attention module lets the KV-cached decode of
    `olmo_eqx.generate` call `project` / `output` on either block kind unchanged.
    """

    projections: Attention
    input_norm: Optional[RMSNorm]  # HF OLMoE: input_layernorm; FlexOlmo: none

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        self.projections = Attention(config, key=key)
        pre_norm = config.architecture == "olmoe"
        self.input_norm = RMSNorm(config.d_model, config.rms_norm_eps, jnp.dtype(config.param_dtype)) if pre_norm else None

    def project(
        self, x: Float[Array, "batch seq d_model"], rope: Rope, *, config: ModelConfig, constrain: Constrain = unconstrained
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """q, k, v of the block input x: the input norm, then OLMo 3's projections."""
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.projections.project(x, rope, config=config, constrain=constrain)

    def output(
        self, context: Float[Array, "batch seq heads head_dim"], constrain: Constrain = unconstrained
    ) -> Float[Array, "batch seq d_model"]:
        return self.projections.output(context, constrain)

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        rope: Rope,
        *,
        config: ModelConfig,
        mask: AttentionMask,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.projections(x, rope, config=config, mask=mask, constrain=constrain)


# ---------------------------------------------------------------------------------------------
# Routing


class Routing(NamedTuple):
    """Where each token goes: its k experts (best first) and their weights, plus the router's
    logits and probabilities over all experts (for the auxiliary losses)."""

    experts: Int[Array, "tokens k"]
    weights: Float[Array, "tokens k"]  # float32
    logits: Float[Array, "tokens n_experts"]  # float32
    probs: Float[Array, "tokens n_experts"]  # float32


class RouterStats(NamedTuple):
    """One layer's router figures (stacked over layers by the scan)."""

    load_balance: Float[Array, ""]
    z_loss: Float[Array, ""]
    load: Float[Array, " n_experts"]  # assignments per expert (sums to tokens * k)


def route(x: Float[Array, "tokens d_model"], router: Float[Array, "d_model n_experts"], config: ModelConfig) -> Routing:
    """Softmax over the experts in float32, then the top k (ties: the lower expert id)."""
    logits = jnp.matmul(x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, config.n_experts_per_token)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights, logits, probs)


def router_stats(routing: Routing) -> RouterStats:
    tokens, k = routing.experts.shape
    n_experts = routing.probs.shape[-1]
    load = jnp.zeros((n_experts,), jnp.float32).at[routing.experts.reshape(-1)].add(1.0)
    fraction = load / (tokens * k)
    mean_prob = jnp.mean(routing.probs, axis=0)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(routing.logits, axis=-1)))
    return RouterStats(n_experts * jnp.sum(fraction * mean_prob), z, load)


# ---------------------------------------------------------------------------------------------
# Experts: dropless (sorted + grouped matmuls) and the dense reference


class Experts(eqx.Module):
    """`n_experts` SwiGLU MLPs, each down(silu(gate(x)) * up(x)), stacked on a leading axis."""

    gate_proj: Float[Array, "n_experts d_model hidden"] = _axes("expert", "embed", "mlp")
    up_proj: Float[Array, "n_experts d_model hidden"] = _axes("expert", "embed", "mlp")
    down_proj: Float[Array, "n_experts hidden d_model"] = _axes("expert", "mlp", "embed")

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        dtype = jnp.dtype(config.param_dtype)
        kg, ku, kd = jax.random.split(key, 3)
        shape_in = (config.n_experts, config.d_model, config.mlp_hidden)
        shape_out = (config.n_experts, config.mlp_hidden, config.d_model)
        self.gate_proj = _truncated_normal(kg, shape_in, config.init_std, dtype)
        self.up_proj = _truncated_normal(ku, shape_in, config.init_std, dtype)
        self.down_proj = _truncated_normal(kd, shape_out, config.init_std, dtype)

    def grouped(
        self, x: Float[Array, "rows d_model"], group_sizes: Int[Array, " n_experts"]
    ) -> Float[Array, "rows d_model"]:
        """Rows sorted by expert (the first group_sizes[0] rows for expert 0, ...) through
        their expert: three grouped matmuls, each row multiplied by its own expert only."""
        w = lambda a: a.astype(x.dtype)  # noqa: E731
        gate = checkpoint_name(jax.lax.ragged_dot(x, w(self.gate_proj), group_sizes), "gate_proj")
        up = checkpoint_name(jax.lax.ragged_dot(x, w(self.up_proj), group_sizes), "up_proj")
        return checkpoint_name(jax.lax.ragged_dot(swiglu(gate, up), w(self.down_proj), group_sizes), "down_proj")

    def everywhere(self, x: Float[Array, "tokens d_model"]) -> Float[Array, "n_experts tokens d_model"]:
        """Every expert on every token (the dense reference)."""
        w = lambda a: a.astype(x.dtype)  # noqa: E731
        gate = jnp.einsum("td,edh->eth", x, w(self.gate_proj))
        up = jnp.einsum("td,edh->eth", x, w(self.up_proj))
        return jnp.einsum("eth,ehd->etd", swiglu(gate, up), w(self.down_proj))


def dropless(x: Float[Array, "tokens d_model"], routing: Routing, experts: Experts) -> Float[Array, "tokens d_model"]:
    """Sort the tokens' k assignments by expert, run each expert over its group, unsort, and
    sum each token's k outputs weighted by the router."""
    k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)  # assignment a = token * k + slot
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    group_sizes = jnp.zeros((experts.gate_proj.shape[0],), jnp.int32).at[flat].add(1)
    out = experts.grouped(x[order // k], group_sizes)
    # Back to assignment order by the inverse permutation (a gather, not a scatter-add).
    return _weighted_sum(out[_inverse(order)], routing.weights)


def _inverse(permutation: Int[Array, " n"]) -> Int[Array, " n"]:
    """The inverse of a permutation, by one scatter (cheaper than sorting it again)."""
    return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(permutation.shape[0], dtype=permutation.dtype))


def _weighted_sum(out: Float[Array, "assignments d_model"], weights: Float[Array, "tokens k"]) -> Float[Array, "tokens d_model"]:
    """Each token's k expert outputs (in assignment order, token * k + slot), summed with the
    router's weights."""
    tokens, k = weights.shape
    return jnp.einsum("tkd,tk->td", out.reshape(tokens, k, -1), weights.astype(out.dtype))


def dense_reference(
    x: Float[Array, "tokens d_model"], routing: Routing, experts: Experts
) -> Float[Array, "tokens d_model"]:
    """The same sum as `dropless`, with every expert computed on every token and masked."""
    n_experts = experts.gate_proj.shape[0]
    combine = jnp.einsum("tk,tke->te", routing.weights, jax.nn.one_hot(routing.experts, n_experts))
    return jnp.einsum("etd,te->td", experts.everywhere(x), combine.astype(x.dtype))


def expert_parallel_axis(constrain: Constrain, n_experts: int) -> Optional[str]:
    """The mesh axis the experts are split over (expert parallelism), or None: no mesh, or the
    rules' "expert" axis absent or of size 1."""
    mesh, rules = getattr(constrain, "mesh", None), getattr(constrain, "rules", None)
    if mesh is None or rules is None:
        return None
    axis = rules.mesh_axes("expert")
    if not isinstance(axis, str) or mesh.shape.get(axis, 1) <= 1:
        return None
    if n_experts % mesh.shape[axis]:
        raise ValueError(
            f"expert parallelism: n_experts={n_experts} is not divisible by mesh.{axis}={mesh.shape[axis]}; "
            f"choose mesh.{axis} among the divisors of {n_experts}"
        )
    return axis


def _exchange(
    x: Float[Array, "tokens d_model"],
    experts_of: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    local: Experts,
    axis: str,
    peers: int,
) -> Float[Array, "tokens d_model"]:
    """One device's share of `expert_parallel` (inside shard_map): this device's tokens in,
    their MoE output out; `local` holds this device's E/P experts."""
    tokens, k = experts_of.shape
    d_model = x.shape[-1]
    per_peer = local.gate_proj.shape[0]  # E / P: peer p holds experts p * per_peer ...
    slots = tokens * min(k, per_peer)  # the worst case one peer can be sent (dropless)
    all_to_all = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)  # noqa: E731

    # Sort the assignments by expert: those for peer p are then contiguous, by local expert.
    flat = experts_of.reshape(-1)  # assignment a = token * k + slot
    order = jnp.argsort(flat, stable=True)
    counts = jnp.zeros((peers * per_peer,), jnp.int32).at[flat].add(1)
    to_peer = jnp.sum(counts.reshape(peers, per_peer), axis=1)
    peer = flat[order] // per_peer
    row = jnp.arange(flat.shape[0]) - (jnp.cumsum(to_peer) - to_peer)[peer]  # row in peer's slots
    send = jnp.zeros((peers, slots, d_model), x.dtype).at[peer, row].set(x[order // k])
    received = all_to_all(send)  # received[p]: rows from peer p, by our local expert
    received_counts = all_to_all(counts.reshape(peers, per_peer))  # [source peer, local expert]

    # Regroup everything received by local expert (the unused slots, key per_peer, go last).
    ends = jnp.cumsum(received_counts, axis=1)
    expert_of_row = jnp.sum(jnp.arange(slots)[None, :, None] >= ends[:, None, :], axis=-1)
    regroup = jnp.argsort(expert_of_row.reshape(-1), stable=True)
    done = local.grouped(received.reshape(-1, d_model)[regroup], jnp.sum(received_counts, axis=0))
    back = all_to_all(done[_inverse(regroup)].reshape(peers, slots, d_model))  # back[p]: our rows, from peer p
    return _weighted_sum(back[peer, row][_inverse(order)], weights)


def _gather_and_scatter(
    x: Float[Array, "tokens d_model"],
    experts_of: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    local: Experts,
    axis: str,
    peers: int,
) -> Float[Array, "tokens d_model"]:
    """`_exchange` by all-gather + reduce-scatter: every device of the expert group gets all of
    the group's tokens (P x T rows, each token once whatever its k), runs its local experts on
    the assignments that reach them, weights and sums them per token, and the partial sums are
    reduce-scattered back to the tokens' devices."""
    tokens, k = experts_of.shape
    per_peer = local.gate_proj.shape[0]
    gather = lambda a: jax.lax.all_gather(a, axis, tiled=True)  # noqa: E731
    everyone, their_experts, their_weights = gather(x), gather(experts_of), gather(weights)
    mine = their_experts - jax.lax.axis_index(axis) * per_peer  # local expert id, if in range
    key = jnp.where((mine >= 0) & (mine < per_peer), mine, per_peer).reshape(-1)
    # At most min(k, E/P) of a token's k assignments are ours: that many rows per token suffice.
    order = jnp.argsort(key, stable=True)[: peers * tokens * min(k, per_peer)]
    group_sizes = jnp.zeros((per_peer + 1,), jnp.int32).at[key].add(1)[:per_peer]
    token = order // k
    done = local.grouped(everyone[token], group_sizes)
    weight = jnp.where(key[order] < per_peer, their_weights.reshape(-1)[order], 0.0).astype(done.dtype)
    partial = jnp.zeros_like(everyone).at[token].add(done * weight[:, None])
    return jax.lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)


def expert_parallel(
    x: Float[Array, "batch seq d_model"],
    routing: Routing,
    experts: Experts,
    constrain: Constrain,
    axis: str,
    exchange: str = "all_to_all",
) -> Float[Array, "batch seq d_model"]:
    """`dropless` with the experts split over the mesh axis `axis`, tokens exchanged by
    all-to-all under `shard_map` (see the module doc for the buffers' sizes).

    Each device keeps its tokens (the batch and sequence split of the activations) and gets
    its experts' weights whole along the model dimension (FSDP's gather at the boundary)."""
    mesh = constrain.mesh
    spec = constrain.spec(x.shape, HIDDEN)
    tokens = P(spec[0], spec[1], None)
    per_token = lambda a: a.reshape(*x.shape[:2], -1)  # noqa: E731

    def shard(x, experts_of, weights, local):
        rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
        run_local = _exchange if exchange == "all_to_all" else _gather_and_scatter
        return run_local(rows(x), rows(experts_of), rows(weights), local, axis, mesh.shape[axis]).reshape(x.shape)

    run = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, jax.tree.map(lambda _: P(axis, None, None), experts)),
        out_specs=tokens,
        check_vma=False,
    )
    return run(x, per_token(routing.experts), per_token(routing.weights), experts)


class MoE(eqx.Module):
    """Router + experts: [batch, seq, d_model] -> the same shape, and the layer's router stats."""

    router: Float[Array, "d_model n_experts"] = _axes("embed", "expert")
    experts: Experts
    config: ModelConfig = eqx.field(static=True)  # k, norm_topk_prob, moe_impl

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        self.config = config
        kr, ke = jax.random.split(key)
        shape = (config.d_model, config.n_experts)
        self.router = _truncated_normal(kr, shape, config.init_std, jnp.dtype(config.param_dtype))
        self.experts = Experts(config, key=ke)

    def __call__(
        self, x: Float[Array, "batch seq d_model"], constrain: Constrain = unconstrained
    ) -> tuple[Float[Array, "batch seq d_model"], RouterStats]:
        config = self.config
        flat = x.reshape(-1, x.shape[-1])  # routing is per token: batch and sequence merge
        routing = route(flat, self.router, config)
        axis = None if config.moe_impl == "dense" else expert_parallel_axis(constrain, config.n_experts)
        if axis is not None:
            out = expert_parallel(x, routing, self.experts, constrain, axis, config.moe_exchange)
        else:
            combine = dense_reference if config.moe_impl == "dense" else dropless
            out = combine(flat, routing, self.experts).reshape(x.shape)
        return constrain(out, HIDDEN), router_stats(routing)


# ---------------------------------------------------------------------------------------------
# The block and the model


class MoEBlock(eqx.Module):
    attention: MoEAttention
    # OLMoE uses the pre-norms (attention.input_norm, mlp_input_norm), FlexOlmo the output norms
    # (attention_norm, mlp_norm); the other pair is None.
    attention_norm: Optional[RMSNorm]  # FlexOlmo: post_attention_layernorm
    mlp_input_norm: Optional[RMSNorm]  # OLMoE: post_attention_layernorm (the MLP's pre-norm)
    moe: MoE
    mlp_norm: Optional[RMSNorm]  # FlexOlmo: post_feedforward_layernorm

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        norm = lambda: RMSNorm(config.d_model, config.rms_norm_eps, jnp.dtype(config.param_dtype))  # noqa: E731
        pre_norm = config.architecture == "olmoe"
        self.attention = MoEAttention(config, key=ka)
        self.attention_norm = None if pre_norm else norm()
        self.mlp_input_norm = norm() if pre_norm else None
        self.moe = MoE(config, key=km)
        self.mlp_norm = None if pre_norm else norm()

    def __call__(
        self,
        x: Float[Array, "batch seq d_model"],
        rope: Rope,
        *,
        config: ModelConfig,
        mask: AttentionMask,
        constrain: Constrain = unconstrained,
    ) -> tuple[Float[Array, "batch seq d_model"], RouterStats]:
        attention = self.attention(x, rope, config=config, mask=mask, constrain=constrain)
        return self.moe_after_attention(x, attention, constrain)

    def moe_after_attention(
        self,
        x: Float[Array, "batch seq d_model"],
        attention: Float[Array, "batch seq d_model"],
        constrain: Constrain = unconstrained,
    ) -> tuple[Float[Array, "batch seq d_model"], RouterStats]:
        """The residual adds and the MoE, once attention's output is known."""
        if self.attention_norm is not None:
            attention = self.attention_norm(attention)
        h = constrain(x + attention, HIDDEN)
        moe_in = h if self.mlp_input_norm is None else self.mlp_input_norm(h)
        moe_out, stats = self.moe(moe_in, constrain)
        if self.mlp_norm is not None:
            moe_out = self.mlp_norm(moe_out)
        return constrain(h + moe_out, HIDDEN), stats

    def after_attention(
        self,
        x: Float[Array, "batch seq d_model"],
        attention: Float[Array, "batch seq d_model"],
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        """`moe_after_attention` without the stats: what the KV-cached decode calls."""
        return self.moe_after_attention(x, attention, constrain)[0]


class MoELM(CausalLM):
    """An OLMoE / FlexOlmo causal language model: token ids in, float32 logits out."""

    embed: Float[Array, "padded_vocab d_model"] = _axes("vocab", "embed")
    blocks: MoEBlock = eqx.field(metadata={"stacked": True})  # every array: (n_layers, ...)
    final_norm: RMSNorm
    lm_head: Float[Array, "d_model padded_vocab"] = _axes("embed", "vocab")
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: PRNGKeyArray):
        if config.architecture not in MOE_ARCHITECTURES or config.n_experts is None:
            raise ValueError(
                f"model {config.name!r}: MoELM builds {' and '.join(MOE_ARCHITECTURES)} with n_experts set, "
                f"got architecture={config.architecture!r}, n_experts={config.n_experts}"
            )
        dtype = jnp.dtype(config.param_dtype)
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.config = config
        self.embed = _truncated_normal(k_embed, (config.padded_vocab_size, config.d_model), config.init_std, dtype)
        self.blocks = eqx.filter_vmap(lambda k: MoEBlock(config, key=k))(jax.random.split(k_blocks, config.n_layers))
        self.final_norm = RMSNorm(config.d_model, config.rms_norm_eps, dtype)
        self.lm_head = _truncated_normal(k_head, (config.d_model, config.padded_vocab_size), config.init_std, dtype)

    def hidden_states_and_aux(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Optional[Int[Array, "batch seq"]] = None,
        *,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> tuple[Float[Array, "batch seq d_model"], dict[str, Float[Array, ""]]]:
        config = self.config
        if positions is None:
            positions = jnp.arange(tokens.shape[1])[None, :]
        else:
            positions = constrain(positions, ("batch", "sequence"))
        x = embed_tokens(self.embed, tokens, config.compute_dtype, constrain)
        rope = Rope(positions, config, yarn=config.yarn is not None, platform=program_platform(constrain))
        mask = AttentionMask(None, segment_ids)

        def apply_block(block: MoEBlock, x):
            return block(x, rope, config=config, mask=mask, constrain=constrain)

        if config.remat != "none":
            apply_block = jax.checkpoint(apply_block, policy=_REMAT_POLICIES[config.remat])

        def layer(x, block: MoEBlock):
            return apply_block(block, x)

        x, stats = over_layers(layer, x, self.blocks, scanned=config.scanned)
        return self.final_norm(x), self.aux_terms(stats)

    def aux_terms(self, stats: RouterStats) -> dict[str, Float[Array, ""]]:
        """The weighted router losses (the objective's share) and the figures to watch."""
        config = self.config
        load_balance, z_loss = jnp.mean(stats.load_balance), jnp.mean(stats.z_loss)
        terms = {
            AUX_OBJECTIVE: config.router_aux_loss_coef * load_balance + config.router_z_loss_coef * z_loss,
            "router_load_balance": load_balance,
            "router_z_loss": z_loss,
            # Dropless routing: no token ever misses an expert. Reported so a run shows it.
            "moe_dropped_tokens": jnp.zeros((), jnp.float32),
        }
        # Each layer's busiest expert relative to a perfectly even load (1.0 = balanced).
        busiest = jnp.max(stats.load, axis=-1) / jnp.mean(stats.load, axis=-1)
        for layer in range(config.n_layers):
            terms[f"moe_max_load/layer_{layer}"] = busiest[layer]
        return terms

    def hidden_states(
        self,
        tokens: Int[Array, "batch seq"],
        positions: Optional[Int[Array, "batch seq"]] = None,
        *,
        segment_ids: Optional[Int[Array, "batch seq"]] = None,
        constrain: Constrain = unconstrained,
    ) -> Float[Array, "batch seq d_model"]:
        return self.hidden_states_and_aux(tokens, positions, segment_ids=segment_ids, constrain=constrain)[0]

    def logits(
        self, hidden: Float[Array, "*batch d_model"], *, constrain: Constrain = unconstrained
    ) -> Float[Array, "*batch vocab"]:
        logits = jnp.einsum("...d,dv->...v", hidden, self.lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32)
        if logits.ndim == 3:
            logits = constrain(logits, ("batch", "sequence", "act_vocab"))
        return logits[..., : self.config.vocab_size]
