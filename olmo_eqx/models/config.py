"""The one description of a model's architecture and numerics.

A `ModelConfig` is plain data (a frozen dataclass of ints, floats and strings) so that Hydra
can compose it, checkpoints can store it, and two configs can be compared for equality.
"""

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

# "auto": cuDNN flash attention on GPU (bf16), Pallas splash on TPU, "blockwise" elsewhere.
AttentionImpl = Literal["auto", "blockwise", "xla", "cudnn", "splash", "reference"]
# "dropless": tokens sorted by expert, grouped matmuls (the training path); "dense": every
# expert on every token, masked (a reference for tests; E/k times the FLOPs).
MoEImpl = Literal["dropless", "dense"]
# Expert parallelism's token exchange (olmoe.py): "all_to_all" sends each assignment to its
# expert's device in fixed worst-case slots; "all_gather" gathers the tokens of the expert
# group and reduce-scatters the results (fewer bytes when min(k, experts per device) > 1).
MoEExchange = Literal["all_to_all", "all_gather"]
# Up to this many layers, `scan_layers: null` unrolls the layers of a TPU program.
TPU_UNROLLED_LAYERS = 16

LogitsDtype = Literal["float32", "compute"]
RematPolicy = Literal["none", "full", "save_matmuls", "save_projections", "save_attention", "save_context", "save_outputs", "save_qkv", "offload_projections", "offload_context"]
DType = Literal["float32", "bfloat16"]
Quantization = Literal["int8"]
LayerKind = Literal["gdn", "attention"]


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling, applied to the full-attention layers only (OLMo 3 stage 3)."""

    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # None means the YaRN paper's default, 0.1 * ln(factor) + 1.
    attention_factor: Optional[float] = None


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of an OLMo 2 / OLMo 3 decoder plus its dtype, attention and remat policy.

    The defaults are `olmo3_tiny`, the CPU-sized model of tests and the default pretrain run.
    """

    name: str = "olmo3_tiny"
    # Which module of the zoo this is (`olmo_eqx.models.registry.ARCHITECTURES`): "olmo3" is
    # the OLMo 2 / OLMo 3 decoder (OLMo 2: sliding_window=None); "olmoe" and "flex_olmo"
    # the mixture-of-experts decoders of `olmoe.py`; "olmo" OLMo 1 (`olmo1.py`); "olmo_hybrid"
    # Gated DeltaNet layers between OLMo 3 attention layers (`olmo_hybrid.py`).
    architecture: str = "olmo3"
    vocab_size: int = 4096
    # Rows of the embedding and output head; a multiple of 128 for fast matmuls. Logits are
    # returned over `vocab_size` only, so padding never changes the model's predictions.
    padded_vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 32
    mlp_hidden: int = 384
    # Window (including the current token) of the sliding-attention layers; None makes every
    # layer full attention (OLMo 2).
    sliding_window: Optional[int] = 64
    # Layer i is full attention when i % full_attention_every == full_attention_every - 1.
    full_attention_every: int = 4
    rope_theta: float = 500_000.0
    yarn: Optional[YarnConfig] = None
    rms_norm_eps: float = 1e-6
    max_sequence_length: int = 1024
    init_std: float = 0.02
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    # How the model runs, not what it is: free to change between a checkpoint and its resume.
    attention_impl: AttentionImpl = "auto"
    # Query/key block of the blockwise and splash kernels; None: 64 on CPU (cache-sized),
    # 512 on accelerators. Splash needs a multiple of 128.
    attention_block_size: Optional[int] = None
    remat: RematPolicy = "none"
    # The sliding-window layers' own policy (None: `remat`'s). At long sequences a full layer's
    # attention costs far more to run again than a sliding one's, so keeping only the full
    # layers' context can beat recomputing all where keeping every layer's does not fit:
    # olmo3_600m at 2 x 32,768 on a v5e, `remat=save_context remat_sliding=full`.
    remat_sliding: Optional[RematPolicy] = None
    # "int8": the attention and dense-MLP projections run as int8 matmuls forward and backward
    # through Google's Qwix (`quantization.py`; weights and optimiser state stay float32; MoE
    # experts and Gated DeltaNet layers keep the compute dtype); null: none.
    quantization: Optional[Quantization] = None
    # Sequence positions per chunk of the training loss: the logits of one chunk
    # ([batch, chunk, vocab]) exist at a time, rematerialised in the backward pass.
    loss_chunk_size: int = 1024
    # What the head's matmul writes its logits in; the loss itself always runs in float32.
    # "compute": the compute dtype, as OLMo-core under FSDP's bf16 mixed precision (its LM head
    # outputs bf16 logits, its cross-entropy upcasts them) and HF's bf16 models; every pass
    # over a chunk's logits moves half the bytes (olmo3_600m on a v5e: the head 406 -> 324 ms
    # a step, with 1024-token chunks). "float32": the matmul's float32 sums, unrounded.
    logits_dtype: LogitsDtype = "compute"
    # Layers run as a scan over attention cycles (one compiled cycle: compile time and HLO
    # independent of depth, what large models need) or unrolled (no loop: about 6% faster
    # steps on CPU for small models, 6-7% on a TPU). None: unrolled up to 2 cycles (8 OLMo 3
    # layers), on a TPU up to 16 layers (`scanned_on`).
    scan_layers: Optional[bool] = None
    # Mixture of experts (architecture "olmoe" / "flex_olmo"; dense models leave these alone).
    # Every layer's MLP becomes `n_experts` SwiGLU experts of width `mlp_hidden`, of which a
    # router picks `n_experts_per_token` per token (softmax, then top-k).
    n_experts: Optional[int] = None
    n_experts_per_token: int = 8
    # Renormalise the chosen experts' probabilities to sum to 1 (OLMoE and FlexOlmo: no).
    norm_topk_prob: bool = False
    # Weights of the router's load-balancing loss and z-loss in the objective (OLMoE's).
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    # Clamp q, k and v to [-clip_qkv, clip_qkv] after the QK-norm (HF OLMoE's `clip_qkv`;
    # OLMo 1, which has no QK-norm: right after the projections).
    clip_qkv: Optional[float] = None
    moe_impl: MoEImpl = "dropless"
    # How expert parallelism moves tokens (how the model runs, not what it is).
    moe_exchange: MoEExchange = "all_to_all"
    # OLMo-Hybrid (architecture "olmo_hybrid"; other models leave these alone). Its layers run
    # `layer_pattern` over and over (one scanned cycle): "gdn" a Gated DeltaNet layer (pre-norm),
    # "attention" an OLMo 3 full-attention layer (reordered norm, QK-norm).
    layer_pattern: tuple[LayerKind, ...] = ("gdn", "gdn", "gdn", "attention")
    # Gated DeltaNet: value heads (the state's heads), key heads (q/k heads, each shared by
    # gdn_heads // gdn_key_heads value heads), their dims, the short convolution's width.
    gdn_heads: int = 4
    gdn_key_heads: int = 4
    gdn_key_dim: int = 24
    gdn_value_dim: int = 48
    gdn_conv_kernel: int = 4
    # Write strength beta in (0, 2) instead of (0, 1): the state's update may have negative
    # eigenvalues (HF: linear_allow_neg_eigval).
    gdn_allow_neg_eigval: bool = True
    # Tokens per chunk of the chunked delta-rule kernel (how the model runs, not what it is).
    gdn_chunk_size: int = 64
    # RoPE on the attention layers; False is NoPE (OLMo-Hybrid's released stage-3 model).
    use_rope: bool = True

    def __post_init__(self):
        problems = []
        if self.architecture in ("olmoe", "flex_olmo"):
            if self.n_experts is None or self.n_experts < 1:
                problems.append(f"architecture {self.architecture!r} needs n_experts >= 1 (got {self.n_experts})")
            elif not 1 <= self.n_experts_per_token <= self.n_experts:
                problems.append(
                    f"n_experts_per_token={self.n_experts_per_token} must be between 1 and n_experts={self.n_experts}"
                )
            if self.sliding_window is not None:
                problems.append(f"architecture {self.architecture!r} has no sliding window; set sliding_window: null")
        if self.architecture == "olmo" and self.sliding_window is not None:
            problems.append("architecture 'olmo' (OLMo 1) has no sliding window; set sliding_window: null")
        if self.architecture == "olmo_hybrid":
            if self.sliding_window is not None:
                problems.append("architecture 'olmo_hybrid' has no sliding window; set sliding_window: null")
            if set(self.layer_pattern) != {"gdn", "attention"}:
                problems.append(f"layer_pattern={list(self.layer_pattern)} needs both 'gdn' and 'attention' layers")
            if self.gdn_heads % self.gdn_key_heads:
                problems.append(f"gdn_heads={self.gdn_heads} must be a multiple of gdn_key_heads={self.gdn_key_heads}")
            if self.gdn_chunk_size < 1:
                problems.append(f"gdn_chunk_size={self.gdn_chunk_size} must be >= 1")
        if self.padded_vocab_size < self.vocab_size:
            problems.append(
                f"padded_vocab_size={self.padded_vocab_size} is smaller than vocab_size={self.vocab_size}; "
                "set padded_vocab_size to vocab_size rounded up to a multiple of 128"
            )
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.n_layers % self.cycle_length:
            problems.append(
                f"n_layers={self.n_layers} must be a multiple of the attention cycle length "
                f"{self.cycle_length} (layers are scanned one cycle at a time)"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window={self.sliding_window} must be >= 1 (or null for full attention)")
        if self.remat_sliding is not None and self.sliding_window is None:
            problems.append(
                f"remat_sliding={self.remat_sliding!r} is the sliding-window layers' policy and this model has none; "
                "set remat_sliding: null and use remat"
            )
        if self.loss_chunk_size < 1:
            problems.append(f"loss_chunk_size={self.loss_chunk_size} must be >= 1")
        if problems:
            raise ValueError(f"invalid model config {self.name!r}: " + "; ".join(problems))

    @property
    def cycle_length(self) -> int:
        """Layers per scanned cycle: 4 for OLMo 3's 3 sliding + 1 full, 1 when all are full,
        the layer pattern's length for OLMo-Hybrid."""
        if self.architecture == "olmo_hybrid":
            return len(self.layer_pattern)
        return 1 if self.sliding_window is None else self.full_attention_every

    @property
    def scanned(self) -> bool:
        """Whether the layers run as a scan (see `scan_layers`)."""
        if self.scan_layers is not None:
            return self.scan_layers
        return self.n_layers // self.cycle_length > 2

    def scanned_on(self, platform: str) -> bool:
        """`scanned` for a program compiled for `platform`: on a TPU, models of up to
        `TPU_UNROLLED_LAYERS` layers run unrolled (measured on a v5e at 16 x 4096 tokens,
        together with 1024-token splash blocks: olmo3_190m 41.9K -> 44.8K tok/s, olmo3_600m
        18.9K -> 20.1K; compile 28 -> 49-61 s; docs/performance.md "Speed on TPU")."""
        if self.scan_layers is None and platform == "tpu":
            return self.n_layers > TPU_UNROLLED_LAYERS
        return self.scanned

    def remat_of(self, *, sliding: bool) -> RematPolicy:
        """The remat policy of a sliding-window layer or of a full-attention one."""
        return self.remat_sliding if sliding and self.remat_sliding is not None else self.remat

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return layer % self.full_attention_every != self.full_attention_every - 1

    @property
    def layer_types(self) -> list[str]:
        """HF's names for each layer's attention kind."""
        if self.architecture == "olmo_hybrid":
            kinds = {"gdn": "linear_attention", "attention": "full_attention"}
            return [kinds[self.layer_pattern[i % self.cycle_length]] for i in range(self.n_layers)]
        return ["sliding_attention" if self.is_sliding(i) else "full_attention" for i in range(self.n_layers)]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# Fields that only some architectures read (the others ignore them). `--cfg job` shows them only
# for those, so a plain OLMo 3's config does not list Gated DeltaNet or expert settings.
_MOE_FIELDS = ("n_experts", "n_experts_per_token", "norm_topk_prob", "router_aux_loss_coef",
               "router_z_loss_coef", "moe_impl", "moe_exchange")
_HYBRID_FIELDS = ("layer_pattern", "gdn_heads", "gdn_key_heads", "gdn_key_dim", "gdn_value_dim",
                  "gdn_conv_kernel", "gdn_allow_neg_eigval", "gdn_chunk_size", "use_rope")
_READ_ONLY_BY: dict[str, tuple[str, ...]] = {
    **{name: ("olmoe", "flex_olmo") for name in _MOE_FIELDS},
    **{name: ("olmo_hybrid",) for name in _HYBRID_FIELDS},
}


def unused_fields(values: dict) -> list[str]:
    """The fields of a model config (as plain values) that its architecture does not read and
    that still hold their defaults: what a shown config can leave out without hiding a choice."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    architecture = values.get("architecture", defaults["architecture"])

    def is_default(name: str) -> bool:
        value = values[name]
        default = defaults[name]
        return (list(value) if isinstance(value, (list, tuple)) else value) == (list(default) if isinstance(default, tuple) else default)

    return [name for name, readers in _READ_ONLY_BY.items()
            if architecture not in readers and name in values and is_default(name)]
