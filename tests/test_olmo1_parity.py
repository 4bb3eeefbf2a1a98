"""OLMo 1 (olmo1.py) against HF transformers' OlmoForCausalLM, in float32.

As tests/test_model_parity.py: a random HF model written with `save_pretrained` and read with
`load_hf`; logits, loss, every gradient, the round trip back to HF files (exact both ways) and
greedy generation compared, and a row of packed documents against HF on each document. OLMo 1's norms have no weights, so nothing needs perturbing; the
clipped case uses a clip small enough that the clamp bites.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from olmo_eqx import load_hf, save_hf
from olmo_eqx.interop.generate import generate
from olmo_eqx.interop.hf import hf_state_dict

VOCAB = 200  # not a multiple of 128: padding is exercised
SEQ = 24
BATCH = 2


@dataclasses.dataclass(frozen=True)
class Case:
    n_kv_heads: int = 4
    clip_qkv: float | None = None

    @property
    def id(self) -> str:
        return f"kv{self.n_kv_heads}" + (f"-clip{self.clip_qkv}" if self.clip_qkv else "")


CASES = [Case(), Case(n_kv_heads=2, clip_qkv=0.5)]


def build_hf_model(case: Case, seed: int = 0) -> transformers.PreTrainedModel:
    config = transformers.OlmoConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=case.n_kv_heads,
        max_position_embeddings=128,
        initializer_range=0.2,  # logits far from zero; projections large enough for the clip to bite
        clip_qkv=case.clip_qkv,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.OlmoForCausalLM(config).float().eval()


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def pair(request, tmp_path_factory):
    case = request.param
    hf_model = build_hf_model(case)
    directory = tmp_path_factory.mktemp(case.id)
    hf_model.save_pretrained(directory)
    ours = load_hf(directory)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ))
    return case, hf_model, ours, tokens, directory


def mean_next_token_loss(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_config_read_from_hf(pair):
    case, _, ours, _, _ = pair
    config = ours.config
    assert config.architecture == "olmo" and config.sliding_window is None
    assert config.clip_qkv == case.clip_qkv and config.n_kv_heads == case.n_kv_heads
    assert config.padded_vocab_size == 256 and config.rope_theta == 10_000.0
    assert jax.tree.leaves(ours.final_norm) == []  # non-parametric


def test_logits_match_pytorch(pair):
    case, hf_model, ours, tokens, _ = pair
    with torch.no_grad():
        expected = hf_model(torch.as_tensor(tokens)).logits.numpy()
    got = np.asarray(eqx.filter_jit(lambda m, t: m(t))(ours, jnp.asarray(tokens)))
    err, scale = np.abs(got - expected).max(), np.abs(expected).max()
    print(f"{case.id}: max|dlogits|/max|logits| = {err / scale:.2e}")
    assert err <= 1e-5 * scale
    if case.clip_qkv is not None:  # the clamp is active: without it the logits differ
        unclipped = eqx.filter_jit(lambda m, t: m(t))(
            jax.tree.unflatten(jax.tree.structure(load_hf(pair[4], clip_qkv=None)), jax.tree.leaves(ours)),
            jnp.asarray(tokens),
        )
        assert np.abs(np.asarray(unclipped) - expected).max() > 100 * 1e-5 * scale


def test_packed_documents_match_pytorch_on_each_document(pair):
    """Row 0 packs three documents (positions restarting at each): under document masking its
    logits equal HF's on each document alone (OLMo 1 masks through the shared attention path)."""
    case, hf_model, ours, tokens, _ = pair
    cuts = [0, 7, 16, SEQ]
    segment_ids = np.zeros((BATCH, SEQ), np.int32)
    positions = np.tile(np.arange(SEQ), (BATCH, 1))
    for d, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        segment_ids[0, a:b] = d
        positions[0, a:b] = np.arange(b - a)
    logits = eqx.filter_jit(lambda m, t, p, s: m(t, p, segment_ids=s))
    got = np.asarray(logits(ours, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)))
    with torch.no_grad():
        expected = np.concatenate(
            [hf_model(torch.as_tensor(tokens[:1, a:b])).logits.numpy() for a, b in zip(cuts[:-1], cuts[1:])], axis=1
        )
        unpacked = hf_model(torch.as_tensor(tokens[1:])).logits.numpy()
    scale = np.abs(expected).max()
    assert np.abs(got[:1] - expected).max() <= 1e-5 * scale, case.id
    assert np.abs(got[1:] - unpacked).max() <= 1e-5 * np.abs(unpacked).max(), case.id
    unmasked = np.asarray(eqx.filter_jit(lambda m, t, p: m(t, p))(ours, jnp.asarray(tokens), jnp.asarray(positions)))
    assert np.abs(unmasked[:1] - expected).max() > 100 * 1e-5 * scale  # the mask matters here


def test_loss_and_gradients_match_pytorch(pair):
    case, hf_model, ours, tokens, _ = pair
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


def test_save_hf_roundtrip(pair, tmp_path):
    """Ours -> HF files -> transformers gives the same logits; HF files -> ours -> HF files is exact."""
    case, hf_model, ours, tokens, directory = pair
    save_hf(ours, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded) is transformers.OlmoForCausalLM and reloaded.config.clip_qkv == case.clip_qkv
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), hf_model.state_dict().items()):
        assert torch.equal(a, b), name
    again = load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(ours)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.config == ours.config


def test_greedy_generate_matches_pytorch(pair):
    case, hf_model, ours, tokens, _ = pair
    prompts = tokens[:, :10]
    with torch.no_grad():
        expected = hf_model.generate(torch.as_tensor(prompts), max_new_tokens=8, do_sample=False).numpy()[:, 10:]
    assert generate(ours, prompts, 8) == expected.tolist()
