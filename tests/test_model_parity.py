"""Our OLMo 3 / OLMo 2 against the PyTorch reference (HF transformers), in float32.

Each case builds a random HF model (norm weights perturbed away from 1 so a swapped or missing
norm shows), writes it with `save_pretrained`, reads it with `load_hf`, and compares logits,
loss and every gradient. Sequences are longer than twice the sliding window so the window matters.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from olmo_eqx import load_hf, save_hf, with_config
from olmo_eqx.interop.hf import hf_state_dict

VOCAB = 200  # deliberately not a multiple of 128, so padding is exercised
WINDOW = 16
SEQ = 40  # > 2 * WINDOW
BATCH = 2


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # "olmo3" or "olmo2"
    n_kv_heads: int = 4
    yarn: bool = False
    n_layers: int = 4

    @property
    def id(self) -> str:
        kind = "mha" if self.n_kv_heads == 4 else "gqa"
        return f"{self.family}-{kind}{'-yarn' if self.yarn else ''}-{self.n_layers}l"


CASES = [
    Case("olmo3"),
    Case("olmo3", n_kv_heads=2, n_layers=8),
    Case("olmo3", n_kv_heads=2, yarn=True),
    Case("olmo2"),
    Case("olmo2", n_kv_heads=1),
]


def build_hf_model(case: Case, seed: int = 0) -> transformers.PreTrainedModel:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=case.n_layers,
        num_attention_heads=4,
        num_key_value_heads=case.n_kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # large enough that logits are far from zero
        pad_token_id=None,
        eos_token_id=None,
    )
    if case.family == "olmo3":
        full = {"rope_type": "default", "rope_theta": 500_000.0}
        if case.yarn:
            full = {
                "rope_type": "yarn",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            }
        config = transformers.Olmo3Config(
            sliding_window=WINDOW,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0},
                             "full_attention": full},
            **common,
        )
        cls = transformers.Olmo3ForCausalLM
    else:
        config = transformers.Olmo2Config(rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, **common)
        cls = transformers.Olmo2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def pair(request, tmp_path_factory):
    """(case, HF model, our model loaded from the HF checkpoint, token batch)."""
    case = request.param
    hf_model = build_hf_model(case)
    directory = tmp_path_factory.mktemp(case.id)
    hf_model.save_pretrained(directory)
    ours = load_hf(directory)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ))
    return case, hf_model, ours, tokens


def torch_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.as_tensor(tokens)).logits.numpy()


@eqx.filter_jit
def our_logits(model, tokens):
    return model(tokens)


def mean_next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked)


def test_config_roundtrip(pair):
    case, hf_model, ours, _ = pair
    config = ours.config
    assert config.vocab_size == VOCAB and config.padded_vocab_size == 256
    assert config.n_kv_heads == case.n_kv_heads and config.n_layers == case.n_layers
    assert config.sliding_window == (WINDOW if case.family == "olmo3" else None)
    assert (config.yarn is not None) == case.yarn


def test_logits_match_pytorch(pair):
    case, hf_model, ours, tokens = pair
    expected = torch_logits(hf_model, tokens)
    for impl in ("blockwise", "xla", "reference"):
        got = np.asarray(our_logits(with_config(ours, attention_impl=impl), jnp.asarray(tokens)))
        assert got.shape == expected.shape
        err = np.abs(got - expected).max()
        scale = np.abs(expected).max()
        print(f"{case.id} {impl}: max|dlogits| = {err:.3e}, max|logits| = {scale:.3f}, ratio {err / scale:.2e}")
        assert err <= 1e-5 * scale
    # Layers run as a Python loop (OLMo 3's cycles here) or a scan (OLMo 2's 4 one-layer cycles,
    # `ModelConfig.scanned`); each case with more than one cycle checks the other way too.
    if ours.config.n_layers // ours.config.cycle_length > 1:
        flipped = with_config(ours, scan_layers=not ours.config.scanned)
        got = np.asarray(our_logits(flipped, jnp.asarray(tokens)))
        assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max(), f"scan_layers={flipped.config.scanned}"


def test_loss_and_gradients_match_pytorch(pair):
    case, hf_model, ours, tokens = pair
    hf_model.zero_grad()
    out = hf_model(torch.as_tensor(tokens), labels=torch.as_tensor(tokens))
    out.loss.backward()
    torch_grads = {name: p.grad.numpy() for name, p in hf_model.named_parameters()}

    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t: mean_next_token_loss(m(t), t)))(
        ours, jnp.asarray(tokens)
    )
    assert abs(float(loss) - out.loss.item()) <= 1e-6 * abs(out.loss.item())
    our_grads = {name: np.asarray(g) for name, g in hf_state_dict(grads).items()}
    assert set(our_grads) == set(torch_grads)
    worst = 0.0
    for name, expected in torch_grads.items():
        ratio = np.linalg.norm(our_grads[name] - expected) / np.linalg.norm(expected)
        worst = max(worst, ratio)
        assert ratio <= 1e-5, f"{case.id}: gradient of {name} differs by {ratio:.2e} (relative)"
    print(f"{case.id}: worst relative gradient difference {worst:.2e}")


def test_save_hf_roundtrip_loads_in_transformers(pair, tmp_path):
    case, hf_model, ours, tokens = pair
    save_hf(ours, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded) is type(hf_model)
    np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(hf_model, tokens))


def test_bfloat16_compute_stays_close(pair):
    case, hf_model, ours, tokens = pair
    full = np.asarray(our_logits(ours, jnp.asarray(tokens)))
    bf16 = np.asarray(our_logits(with_config(ours, compute_dtype="bfloat16"), jnp.asarray(tokens)))
    assert bf16.dtype == np.float32  # logits stay float32 whatever the compute dtype
    ratio = np.abs(bf16 - full).max() / np.abs(full).max()
    print(f"{case.id}: bf16 compute max|dlogits|/max|logits| = {ratio:.2e}")
    assert ratio < 5e-2  # measured 1.7e-2 .. 3.0e-2 across the cases


def test_parity_would_catch_a_wrong_window(pair):
    """The tolerance above is tight enough to see an off-by-one, missing or spurious window."""
    case, hf_model, ours, tokens = pair
    expected = torch_logits(hf_model, tokens)
    scale = np.abs(expected).max()
    wrong_windows = (WINDOW - 1, WINDOW + 1, None) if case.family == "olmo3" else (WINDOW,)
    for wrong in wrong_windows:
        got = np.asarray(our_logits(with_config(ours, sliding_window=wrong), jnp.asarray(tokens)))
        assert np.abs(got - expected).max() > 100 * 1e-5 * scale, f"window {wrong} went unnoticed"


# Remat changes no loss or gradient beyond float32 rounding; shown on the two layer stacks it wraps: OLMo 3's
# cycles (8 layers: two cycles of 3 sliding + 1 full) and OLMo 2's uniform stack. The
# other cases differ from these only in heads and RoPE, which remat does not touch (21 s less).
@pytest.mark.parametrize("pair", [CASES[1], CASES[4]], ids=lambda c: c.id, indirect=True)
def test_remat_policies_change_nothing(pair):
    case, _, ours, tokens = pair
    loss = lambda m, t: mean_next_token_loss(m(t), t)  # noqa: E731
    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    base_loss, base_grads = grad_fn(ours, jnp.asarray(tokens))
    policies = [dict(remat=p) for p in ("full", "save_matmuls", "save_projections", "save_context", "save_outputs")]
    if ours.config.sliding_window is not None:  # the sliding layers under a policy of their own
        policies.append(dict(remat="save_context", remat_sliding="full"))
    for policy in policies:
        remat_loss, remat_grads = grad_fn(with_config(ours, **policy), jnp.asarray(tokens))
        np.testing.assert_allclose(float(remat_loss), float(base_loss), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(base_grads)):
            a, b = np.asarray(a), np.asarray(b)
            assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), f"remat={policy} changed a gradient"


DOCUMENTS = (7, 20, 13)  # one longer than the window; sums to SEQ


@pytest.mark.parametrize("reset_positions", [False, True], ids=["positions-continue", "positions-reset"])
def test_packed_documents_match_each_document_alone(pair, reset_positions):
    """Intra-document masking: every document of a packed row gives the logits HF gives that
    document on its own, with position_ids continuing across documents (the 2025 OLMo 3 runs)
    or restarting at 0 (OLMo-core since May 2026)."""
    from olmo_eqx.batch import document_layout

    case, hf_model, ours, tokens = pair
    eos = VOCAB - 1
    ends = np.cumsum(DOCUMENTS)
    row = tokens[:1].copy()
    row[row == eos] = 0
    row[0, ends - 1] = eos  # each document ends with its EOS
    segment_ids, positions = document_layout(row, eos, reset_positions=reset_positions)
    model = jax.jit(lambda m, t, p, s: m(t, p, segment_ids=s))
    for impl in ("auto", "reference"):
        got = np.asarray(model(with_config(ours, attention_impl=impl), jnp.asarray(row),
                               None if positions is None else jnp.asarray(positions), jnp.asarray(segment_ids)))
        for start, end in zip(ends - DOCUMENTS, ends):
            doc_positions = np.arange(end - start) if reset_positions else np.arange(start, end)
            with torch.no_grad():
                expected = hf_model(torch.as_tensor(row[:, start:end]),
                                    position_ids=torch.as_tensor(doc_positions)[None]).logits.numpy()
            err = np.abs(got[:, start:end] - expected).max() / np.abs(expected).max()
            assert err <= 1e-5, f"{case.id} {impl}: document [{start}, {end}) differs by {err:.2e}"
