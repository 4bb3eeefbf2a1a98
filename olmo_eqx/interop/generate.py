"""Text generation with a KV cache: prefill the prompts once, then one decode step per token.

    new = olmo_eqx.generate(model, [[5, 6, 7], [8, 9]], 20)                      # greedy
    new = olmo_eqx.generate(model, prompts, 20, temperature=0.8, top_p=0.95, key=jax.random.key(0))

Cache layout. Prompts of different lengths are left-padded to one length P, so every row
writes its t-th token (prompt or generated) into the same *slot* P - len + t: one slot counter
serves the whole batch. A row's RoPE position is its slot minus its first real slot, so
positions count real tokens only (HF's generate derives them from the attention mask the
same way); padding slots are never attended to.

- Full-attention layers keep every slot: [batch, P + max_new_tokens, kv_heads, head_dim].
- OLMo-Hybrid's Gated DeltaNet layers keep no keys at all: a fixed-size float32 state per
  head ([key_dim, value_dim]) and their convolutions' last `kernel - 1` inputs (`HybridCache`).
  The prefill runs the chunked delta rule, each decode step the recurrent one; padding slots
  enter those layers as zeros (HF's `apply_mask_to_padding_states`), which writes nothing.
- Sliding-window layers keep a ring buffer of `sliding_window` slots (slot s at index
  s % window): their memory does not grow with the generated length (3 of OLMo 3's 4
  layers). After slot s is written the ring holds exactly the keys the query at s may see,
  s - window + 1 .. s (a window includes the query itself).

The decode loop is one `lax.while_loop` compiled once per (batch, padded prompt length,
max_new_tokens), rather than a jitted step called from Python per token: no dispatch and no
host round trip per token (olmo3_tiny on 2 CPU cores, batch 1: 1,310 tokens/s against 1,026
for a Python loop of the jitted `decode_step`), and the stop test runs on the device, so the
loop ends as soon as every row has produced a stop id. `prefill` and `decode_step` are the
same two functions the loop runs, public for tests and custom loops.
"""

from collections.abc import Sequence
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from olmo_eqx.models.base import CausalLM
from olmo_eqx.models import gated_deltanet
from olmo_eqx.models.olmo3 import Rope
from olmo_eqx.models.olmo_hybrid import OLMoHybrid, identity_rope
from olmo_eqx.sharding import ShardingRules, activation_sharding

# Prompt lengths are padded up to a multiple of this, so a server-like stream of prompts
# (lm-eval's generate_until) compiles a handful of shapes, not one per prompt length.
PROMPT_BUCKET = 32


class KVCache(eqx.Module):
    """Keys and values of every layer for every slot still needed, plus the slot bookkeeping.

    `keys[j]` / `values[j]` hold cycle position j of every attention cycle (layers j, j + 4,
    ...): [cycles, batch, capacity_j, kv_heads, head_dim], capacity_j the ring size on sliding
    layers and the whole length on full ones. `full_slots` / `ring_slots` say which slot each
    index holds (-1: none yet); `start[b]` is row b's first real slot.
    """

    keys: tuple[Array, ...]
    values: tuple[Array, ...]
    full_slots: Int[Array, " full"]
    ring_slots: Int[Array, " ring"]
    start: Int[Array, " batch"]
    next_slot: Int[Array, ""]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in (*self.keys, *self.values))


def _is_ring(model: CausalLM, j: int) -> bool:
    return model.config.sliding_window is not None and model.config.is_sliding(j)


def _attend_cached(q, keys, values, q_slots, k_slots, start, window: Optional[int]):
    """Masked attention of queries at `q_slots` over keys at `k_slots` (-1: empty), GQA.

    q [b, t, h, d], keys/values [b, k, kvh, d], q_slots [t], k_slots [k], start [b].
    A key is visible when it is real (slot >= the row's start), causal and inside the window.
    Padding queries see only themselves, so nothing is ever a softmax over no keys (NaN
    there would reach real rows through 0 * NaN in probs @ values).
    """
    b, t, h, d = q.shape
    kvh = keys.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, keys, preferred_element_type=jnp.float32) / np.sqrt(d).astype(np.float32)
    qs, ks = q_slots[None, :, None], k_slots[None, None, :]
    allowed = (ks >= start[:, None, None]) & (ks <= qs) & (ks >= 0)
    if window is not None:
        allowed &= ks > qs - window
    allowed |= ks == qs  # a padding query's own key (real queries see it anyway)
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, values)
    return out.reshape(b, t, h, d)


def _write(cache_k, new_k, first_slot, ring: bool, prefill: bool):
    """cache [b, cap, ...] with `new_k` [b, t, ...] written at slots first_slot .. + t - 1."""
    capacity, t = cache_k.shape[1], new_k.shape[1]
    if not ring:
        return jax.lax.dynamic_update_slice_in_dim(cache_k, new_k.astype(cache_k.dtype), first_slot, axis=1)
    if prefill:
        # The prefill starts at slot 0: slots t - capacity .. t - 1 survive, slot s at s % capacity.
        tail = new_k[:, max(t - capacity, 0):].astype(cache_k.dtype)
        if t >= capacity:
            return jnp.roll(tail, (t - capacity) % capacity, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(cache_k, tail, 0, axis=1)
    assert t == 1, "decode writes one slot at a time"
    return jax.lax.dynamic_update_slice_in_dim(cache_k, new_k.astype(cache_k.dtype), first_slot % capacity, axis=1)


def _slot_table(table, slots, ring: bool, prefill: bool):
    capacity, t = table.shape[0], slots.shape[0]
    if capacity == 0:
        return table
    if not ring:
        return jax.lax.dynamic_update_slice_in_dim(table, slots, slots[0], axis=0)
    if prefill:
        tail = slots[max(t - capacity, 0):]
        if t >= capacity:
            return jnp.roll(tail, (t - capacity) % capacity)
        return jax.lax.dynamic_update_slice_in_dim(table, tail, 0, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(table, slots, slots[0] % capacity, axis=0)


class HybridCache(eqx.Module):
    """OLMo-Hybrid's decoding state: keys and values of its attention layers, and the delta-rule
    state and convolution tails of its Gated DeltaNet layers, each [cycles, layers of that kind
    per cycle, batch, ...]; slot bookkeeping as `KVCache`."""

    keys: Array  # [cycles, attention per cycle, batch, capacity, kv_heads, head_dim]
    values: Array
    states: Float[Array, "cycles gdn batch heads key_dim value_dim"]
    conv_tails: tuple[Array, Array, Array]  # q, k, v: [cycles, gdn per cycle, batch, kernel - 1, features]
    full_slots: Int[Array, " full"]
    start: Int[Array, " batch"]
    next_slot: Int[Array, ""]


def _hybrid_empty_cache(model: OLMoHybrid, batch: int, capacity: int, start) -> HybridCache:
    config = model.config
    n_cycles = config.n_layers // config.cycle_length
    n_gdn, n_attention = config.layer_pattern.count("gdn"), config.layer_pattern.count("attention")
    dtype = config.compute_dtype
    kv = jnp.zeros((n_cycles, n_attention, batch, capacity, config.n_kv_heads, config.head_dim), dtype)
    states = jnp.zeros((n_cycles, n_gdn, batch, config.gdn_heads, config.gdn_key_dim, config.gdn_value_dim), jnp.float32)
    key_features, value_features = config.gdn_key_heads * config.gdn_key_dim, config.gdn_heads * config.gdn_value_dim
    tail = lambda features: jnp.zeros((n_cycles, n_gdn, batch, config.gdn_conv_kernel - 1, features), dtype)  # noqa: E731
    return HybridCache(kv, kv, states, (tail(key_features), tail(key_features), tail(value_features)),
                       jnp.full((capacity,), -1, jnp.int32), jnp.asarray(start, jnp.int32), jnp.zeros((), jnp.int32))


def _hybrid_forward(model: OLMoHybrid, cache: HybridCache, tokens, *, prefill: bool, constrain=None):
    """`_forward` for OLMo-Hybrid: attention layers as OLMo 3's full ones, GDN layers from their state."""
    config = model.config
    constrain = constrain or (lambda x, axes: x)
    t = tokens.shape[1]
    slots = cache.next_slot + jnp.arange(t, dtype=jnp.int32)
    positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)
    real = (slots[None, :] >= cache.start[:, None])[..., None]  # [b, t, 1]
    x = jnp.take(model.embed, tokens, axis=0).astype(config.compute_dtype)
    rope = Rope(positions, config, yarn=config.yarn is not None) if config.use_rope else identity_rope(positions, config)
    full_slots = _slot_table(cache.full_slots, slots, ring=False, prefill=prefill)
    kernel = gated_deltanet.chunked if prefill else gated_deltanet.recurrent
    kernel_options = {"chunk_size": config.gdn_chunk_size} if prefill else {}

    def run_cycle(x, inputs):
        gdn, attention, keys, values, states, tails = inputs
        new_keys, new_values, new_states, new_tails = [], [], [], []
        for kind in config.layer_pattern:
            if kind == "gdn":
                i = len(new_states)
                block = jax.tree.map(lambda a: a[i], gdn)
                h = jnp.where(real, block.input_norm(x), 0).astype(x.dtype)
                args, tail = block.gdn.inputs(h, config=config, conv_tails=tuple(c[i] for c in tails), constrain=constrain)
                o, state = kernel(*args, state=states[i], **kernel_options)
                x = block.after_mixer(x, block.gdn.output(o, h, constrain), constrain)
                new_states.append(state)
                new_tails.append(tail)
            else:
                i = len(new_keys)
                block = jax.tree.map(lambda a: a[i], attention)
                q, k, v = block.attention.project(x, rope, config=config, constrain=constrain)
                cache_k = _write(keys[i], k, cache.next_slot, False, prefill)
                cache_v = _write(values[i], v, cache.next_slot, False, prefill)
                if prefill:
                    context = _attend_cached(q, k, v, slots, slots, cache.start, None)
                else:
                    context = _attend_cached(q, cache_k, cache_v, slots, full_slots, cache.start, None)
                x = block.after_attention(x, block.attention.output(context.astype(x.dtype)), constrain)
                new_keys.append(cache_k)
                new_values.append(cache_v)
        tails = tuple(jnp.stack([tail[c] for tail in new_tails]) for c in range(3))
        return x, (jnp.stack(new_keys), jnp.stack(new_values), jnp.stack(new_states), tails)

    gdn_cycles, attention_cycles = model.cycles()
    xs = (gdn_cycles, attention_cycles, cache.keys, cache.values, cache.states, cache.conv_tails)
    x, (keys, values, states, tails) = jax.lax.scan(run_cycle, x, xs)
    logits = model.logits(model.final_norm(x))
    return HybridCache(keys, values, states, tails, full_slots, cache.start, cache.next_slot + t), logits


def _forward(model: CausalLM, cache: KVCache | HybridCache, tokens, *, prefill: bool, constrain=None):
    """Run `tokens` [b, t] at the cache's next slots: (updated cache, logits [b, t, vocab]).

    A prefill (cache empty, first slot 0) attends over its own keys, as a ring may be smaller
    than the prompt; a decode step writes its one slot first and then attends over the cache.
    """
    if isinstance(model, OLMoHybrid):
        return _hybrid_forward(model, cache, tokens, prefill=prefill, constrain=constrain)
    config = model.config
    constrain = constrain or (lambda x, axes: x)
    t = tokens.shape[1]
    slots = cache.next_slot + jnp.arange(t, dtype=jnp.int32)
    positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)
    x = jnp.take(model.embed, tokens, axis=0).astype(config.compute_dtype)
    rope_sliding = Rope(positions, config, yarn=False)
    rope_full = Rope(positions, config, yarn=config.yarn is not None)
    full_slots = _slot_table(cache.full_slots, slots, ring=False, prefill=prefill)
    ring_slots = _slot_table(cache.ring_slots, slots, ring=True, prefill=prefill)

    def run_cycle(x, inputs):
        cycle, keys, values = inputs
        new_keys, new_values = [], []
        for j in range(config.cycle_length):
            block = jax.tree.map(lambda a: a[j], cycle)
            ring = _is_ring(model, j)
            window = config.sliding_window if config.is_sliding(j) else None
            q, k, v = block.attention.project(x, rope_sliding if config.is_sliding(j) else rope_full,
                                              config=config, constrain=constrain)
            cache_k = _write(keys[j], k, cache.next_slot, ring, prefill)
            cache_v = _write(values[j], v, cache.next_slot, ring, prefill)
            if prefill:
                context = _attend_cached(q, k, v, slots, slots, cache.start, window)
            else:
                table = ring_slots if ring else full_slots
                context = _attend_cached(q, cache_k, cache_v, slots, table, cache.start, window)
            x = block.after_attention(x, block.attention.output(context.astype(x.dtype)), constrain)
            new_keys.append(cache_k)
            new_values.append(cache_v)
        return x, (tuple(new_keys), tuple(new_values))

    n_cycles = config.n_layers // config.cycle_length
    cycles = jax.tree.map(lambda a: a.reshape(n_cycles, config.cycle_length, *a.shape[1:]), model.blocks)
    x, (keys, values) = jax.lax.scan(run_cycle, x, (cycles, cache.keys, cache.values))
    logits = model.logits(model.final_norm(x))
    cache = KVCache(keys, values, full_slots, ring_slots, cache.start, cache.next_slot + t)
    return cache, logits


def empty_cache(model: CausalLM, batch: int, capacity: int, start: Int[Array, " batch"]) -> KVCache | HybridCache:
    """A cache for `capacity` slots (prompt + new tokens) of `batch` rows; rows begin at `start`."""
    if isinstance(model, OLMoHybrid):
        return _hybrid_empty_cache(model, batch, capacity, start)
    config = model.config
    ring = min(config.sliding_window, capacity) if config.sliding_window is not None else 0
    n_cycles = config.n_layers // config.cycle_length
    keys, values = [], []
    for j in range(config.cycle_length):
        size = ring if _is_ring(model, j) else capacity
        shape = (n_cycles, batch, size, config.n_kv_heads, config.head_dim)
        keys.append(jnp.zeros(shape, config.compute_dtype))
        values.append(jnp.zeros(shape, config.compute_dtype))
    return KVCache(tuple(keys), tuple(values), jnp.full((capacity,), -1, jnp.int32), jnp.full((ring,), -1, jnp.int32),
                   jnp.asarray(start, jnp.int32), jnp.zeros((), jnp.int32))


@eqx.filter_jit
def prefill(
    model: CausalLM, tokens: Int[Array, "batch prompt"], start: Int[Array, " batch"], capacity: int
) -> tuple[KVCache | HybridCache, Float[Array, "batch vocab"]]:
    """Run left-padded prompts (row b's real tokens from column start[b]) into a fresh cache of
    `capacity` slots; returns it and each row's next-token logits."""
    cache = empty_cache(model, tokens.shape[0], capacity, start)
    cache, logits = _forward(model, cache, tokens, prefill=True)
    return cache, logits[:, -1]


@eqx.filter_jit
def decode_step(
    model: CausalLM, cache: KVCache | HybridCache, tokens: Int[Array, " batch"]
) -> tuple[KVCache | HybridCache, Float[Array, "batch vocab"]]:
    """One token per row at the cache's next slot: (cache, next-token logits)."""
    cache, logits = _forward(model, cache, tokens[:, None], prefill=False)
    return cache, logits[:, 0]


def sample(
    logits: Float[Array, "batch vocab"],
    key: Optional[PRNGKeyArray],
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
) -> Int[Array, " batch"]:
    """Greedy (temperature 0) or a sample from softmax(logits / temperature) cut to the `top_k`
    most likely tokens and to the smallest set whose probability reaches `top_p` (nucleus)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
        # Keep a token when the mass before it is under top_p: the most likely one always stays.
        keep = (cumulative - jax.nn.softmax(ordered, axis=-1)) < top_p
        cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@eqx.filter_jit
def _generate(model, tokens, start, stop_ids, key, max_new_tokens: int, sampling: tuple, constrain):
    temperature, top_k, top_p = sampling
    draw = lambda logits, i: sample(  # noqa: E731
        logits, None if key is None else jax.random.fold_in(key, i), temperature=temperature, top_k=top_k, top_p=top_p
    )
    batch = tokens.shape[0]
    cache = empty_cache(model, batch, tokens.shape[1] + max_new_tokens, start)
    cache = _pin_rows(cache, constrain)
    cache, logits = _forward(model, cache, tokens, prefill=True, constrain=constrain)
    logits = logits[:, -1]
    first = draw(logits, 0)
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stop_ids)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, cache, previous, done, out = carry
        cache, logits = _forward(model, cache, previous[:, None], prefill=False, constrain=constrain)
        cache, logits = _pin_rows(cache, constrain), logits[:, 0]
        token = jnp.where(done, -1, draw(logits, i))
        out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1)
        return i + 1, cache, jnp.maximum(token, 0), done | jnp.isin(token, stop_ids), out

    _, _, _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, first, done, out))
    return out


def _pin_rows(cache, constrain):
    """Keep the cache's rows where the batch is (the mesh's batch axes), like activations."""
    if constrain is None or isinstance(cache, HybridCache):  # the hybrid's cache: left to the compiler
        return cache
    pin = lambda a: constrain(a, ("layers", "batch", "sequence", "act_kv_heads", "head_dim"))  # noqa: E731
    return eqx.tree_at(lambda c: (c.keys, c.values), cache,
                       (tuple(map(pin, cache.keys)), tuple(map(pin, cache.values))))


def left_pad(prompts: Sequence[Sequence[int]], bucket: int = PROMPT_BUCKET, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [batch, P], start [batch]): the prompts right-aligned in P columns (P the longest
    rounded up to `bucket`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token (OLMo has no BOS: start from EOS if empty)")
    width = -(-max(len(p) for p in prompts) // bucket) * bucket
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    start = np.zeros(len(prompts), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = prompt
        start[row] = width - len(prompt)
    return tokens, start


def _batch_rows(mesh: Optional[Mesh], rules: ShardingRules) -> int:
    if mesh is None:
        return 1
    from olmo_eqx.evaluation.scoring import batch_multiple

    return batch_multiple(mesh, rules)


def check_prompt_lengths(prompt_lengths: Sequence[int], max_new_tokens: int, max_sequence_length: int) -> None:
    """Refuse a prompt whose tokens plus `max_new_tokens` run past the model's `max_sequence_length`
    (positions the model was never built for), naming the first such prompt and its length."""
    for number, length in enumerate(prompt_lengths, start=1):
        if length + max_new_tokens > max_sequence_length:
            raise ValueError(
                f"prompt {number} is {length} tokens: with max_new_tokens={max_new_tokens} that is "
                f"{length + max_new_tokens} tokens, above the model's max_sequence_length={max_sequence_length}; "
                f"shorten the prompt or set stage.max_new_tokens<={max(max_sequence_length - length, 0)}"
            )


def generate(
    model: CausalLM,
    prompt_ids: Sequence[Sequence[int]] | Int[np.ndarray, "batch prompt"],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    key: Optional[PRNGKeyArray] = None,
    stop_ids: Sequence[int] = (),
    mesh: Optional[Mesh] = None,
    rules: ShardingRules = ShardingRules(),
) -> list[list[int]]:
    """New token ids for each prompt (a list of token-id lists, any lengths, or a 2-D array).

    temperature 0 is greedy; otherwise `key` is required and `top_k` / `top_p` cut the
    distribution before sampling. A row ends after `max_new_tokens` tokens or with the first
    of `stop_ids` it produces (kept as its last token). With a `mesh`, rows are laid out over
    its batch axes like a training batch (padded with dummy rows to a multiple of them) and the
    model should already be placed on it (`olmo_eqx.sharding.model_shardings`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0 (0 is greedy)")
    if temperature > 0 and key is None:
        raise ValueError("generate: sampling (temperature > 0) needs key=jax.random.key(seed)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1]")
    prompts = [list(map(int, p)) for p in prompt_ids]
    if not prompts:
        raise ValueError("generate: prompt_ids is empty; give at least one prompt")
    vocab = model.config.vocab_size
    bad = next(((r, t) for r, p in enumerate(prompts) for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"generate: prompt {bad[0]} has token id {bad[1]}, outside the model's vocabulary [0, {vocab})")
    n_rows = len(prompts)
    multiple = _batch_rows(mesh, rules)
    prompts += [prompts[0]] * (-len(prompts) % multiple)
    tokens, start = left_pad(prompts)
    constrain = None
    tokens, start = jnp.asarray(tokens), jnp.asarray(start)
    if mesh is not None and mesh.size > 1:
        from olmo_eqx.evaluation.scoring import to_global
        from olmo_eqx.sharding import batch_sharding

        constrain = activation_sharding(mesh, rules)
        rows = NamedSharding(mesh, P(rules.mesh_axes("batch")))
        tokens, start = to_global(np.asarray(tokens), batch_sharding(mesh, rules)), to_global(np.asarray(start), rows)
    sampling = (float(temperature), top_k, top_p)
    out = _generate(model, tokens, start, jnp.asarray(list(stop_ids) or [-2], jnp.int32), key, max_new_tokens,
                    sampling, constrain)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        out = multihost_utils.process_allgather(out, tiled=True)
    out = np.asarray(out)[:n_rows]
    return [[int(t) for t in row if t >= 0] for row in out]
