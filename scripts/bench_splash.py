"""Time splash attention's kernels on the local TPU for several block sizes and layouts.

    python scripts/bench_splash.py                                     # olmo3_190m's layers at 2 x 32,768
    python scripts/bench_splash.py --heads 16 --head-dim 80            # olmo3_600m's
    python scripts/bench_splash.py --mask window:4096 --variants "bq=512" "bq=2048,bkv=1024"

Each variant changes the blocks `models/splash.py` gives the layer (`block_sizes`, 1024-token
blocks): `bq,bkv,bkvc` for the forward kernel, `bq_dkv,bkv_dkv,bkvc_dkv` for the dk/dv (or fused)
backward, `bq_dq,bkv_dq` for the separate dq kernel, `fused=0|1`, `klayout=seq` for K laid
out [head_dim, seq] (the forward's QK^T then needs no transpose of K's block), and `groups=N`
for the heads run N groups at a time (default the model's, `head_groups`: 2 for the 600m's
causal layer at 32,768, `groups=1` all at once). The examples (and groups) run one at a time
(`lax.map`), as the model's long sequences do. It prints each variant's forward
and forward+backward time per layer (median of `--repeats`) beside the first variant's.

A kernel micro-benchmark: what the whole step does with a change is measure_step.py's to say.
On CPU it runs the kernels in interpret mode, which checks the variants build, not their speed.
"""

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from olmo_eqx.models.splash import block_sizes, head_groups

KEYS = ("bq", "bkv", "bkvc", "bq_dkv", "bkv_dkv", "bkvc_dkv", "bq_dq", "bkv_dq", "fused", "klayout", "groups")
DEFAULT_VARIANTS = ("", "bkvc=512", "bkv=1024,bkv_dkv=1024", "bq=512", "klayout=seq")


def parse_variant(text: str, *, seq: int, heads: int, head_dim: int, window) -> tuple[splash.BlockSizes, int]:
    """A variant's splash.BlockSizes and how many groups of heads it runs in: the model's for
    this layer (`models.splash.head_groups` and `block_sizes`, 1024-token blocks, the bench's
    heads all kv heads), then `text`'s changes."""
    changed = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in KEYS or not value:
            raise ValueError(f"bad variant item {item!r} in {text!r}: use key=value with key one of {', '.join(KEYS)}")
        if key != "klayout" and not value.isdigit():
            raise ValueError(f"bad variant item {item!r} in {text!r}: {key} takes a whole number")
        changed[key] = value if key == "klayout" else int(value)
    if "groups" in changed:
        groups = changed.pop("groups")
    else:
        groups = head_groups(seq, 1024, heads, heads, head_dim=head_dim, sliding_window=window)
    if groups < 1 or heads % groups:
        raise ValueError(f"groups={groups} in {text!r} must be at least 1 and divide the {heads} heads")
    sizes = block_sizes(seq, heads // groups, window, 1024, head_dim=head_dim)
    values = dict(bq=sizes.block_q, bkv=sizes.block_kv, bkvc=sizes.block_kv_compute, bq_dkv=sizes.block_q_dkv,
                  bkv_dkv=sizes.block_kv_dkv, bkvc_dkv=sizes.block_kv_dkv_compute, bq_dq=sizes.block_q_dq or 1024,
                  bkv_dq=sizes.block_kv_dq or 1024, fused=sizes.use_fused_bwd_kernel, klayout="head")
    values.update(changed)
    if values["klayout"] not in ("head", "seq"):
        raise ValueError(f"klayout must be head or seq, got {values['klayout']!r} in {text!r}")
    # A changed key block keeps its score tile unless that is named too.
    for block, tile in (("bkv", "bkvc"), ("bkv_dkv", "bkvc_dkv")):
        if block in changed and tile not in changed:
            values[tile] = min(values[tile], values[block])
    fused = bool(values["fused"])
    layout = splash.QKVLayout.SEQ_MINOR if values["klayout"] == "seq" else splash.QKVLayout.HEAD_DIM_MINOR
    return splash.BlockSizes(
        block_q=values["bq"], block_kv=values["bkv"], block_kv_compute=values["bkvc"],
        block_q_dkv=values["bq_dkv"], block_kv_dkv=values["bkv_dkv"], block_kv_dkv_compute=values["bkvc_dkv"],
        block_q_dq=None if fused else values["bq_dq"], block_kv_dq=None if fused else values["bkv_dq"],
        use_fused_bwd_kernel=fused, k_layout=layout,
    ), groups


def _median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mask", default="causal", help="causal or window:W (OLMo's window, the query included)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    args = parser.parse_args(argv)
    if args.mask == "causal":
        window = None
    elif args.mask.startswith("window:") and args.mask[7:].isdigit() and int(args.mask[7:]) > 0:
        window = int(args.mask[7:])
    else:
        print(f"bench_splash.py: --mask must be causal or window:W with W > 0, got {args.mask!r}", file=sys.stderr)
        return 2
    if args.seq % 1024:
        print(f"bench_splash.py: --seq must be a multiple of 1024, got {args.seq}", file=sys.stderr)
        return 2
    try:  # every variant's spelling before the first compile
        for text in args.variants:
            parse_variant(text, seq=args.seq, heads=args.heads, head_dim=args.head_dim, window=window)
    except ValueError as error:
        print(f"bench_splash.py: {error}", file=sys.stderr)
        return 2
    interpret = jax.default_backend() != "tpu"
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    mask = masks.CausalMask((args.seq, args.seq)) if window is None else masks.LocalMask(
        (args.seq, args.seq), window_size=(window - 1, 0), offset=0)
    print(f"{jax.devices()[0].device_kind}: {args.batch} x {args.seq} tokens, {args.heads} heads of {args.head_dim}, "
          f"mask {args.mask}; ms per layer, median of {args.repeats}", flush=True)
    base = None
    for text in args.variants:
        try:
            sizes, groups = parse_variant(text, seq=args.seq, heads=args.heads, head_dim=args.head_dim, window=window)
            with jax.ensure_compile_time_eval():
                kernel = splash.make_splash_mha(masks.MultiHeadMask([mask] * (args.heads // groups)), block_sizes=sizes,
                                                head_shards=1, q_seq_shards=1, interpret=interpret)
            # [batch, heads, ...] -> [batch * groups, heads / groups, ...], as splash_attention splits them
            grouped = tuple(x.reshape(args.batch * groups, args.heads // groups, *x.shape[2:]) for x in (q, k, v, g))
            forward = jax.jit(lambda q, k, v: jax.lax.map(lambda x: kernel(*x), (q, k, v)))

            def both(q, k, v, g):
                out, vjp = jax.vjp(lambda q, k, v: jax.lax.map(lambda x: kernel(*x), (q, k, v)), q, k, v)
                return out, *vjp(g)

            fwd = _median_ms(forward, grouped[:3], args.repeats)
            total = _median_ms(jax.jit(both), grouped, args.repeats)
        except Exception as error:  # a variant the kernel or the chip refuses: say so, go on
            print(f"  {text or 'default':<34} refused: {str(error).splitlines()[0][:150]}", flush=True)
            continue
        base = base or (fwd, total)
        print(f"  {text or 'default':<34} forward {fwd:8.2f}  forward+backward {total:8.2f}  "
              f"({fwd / base[0]:.3f}x, {total / base[1]:.3f}x the first)  fused={int(sizes.use_fused_bwd_kernel)} groups={groups}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
