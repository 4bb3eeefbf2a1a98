"""OLMo-Hybrid (olmo_hybrid.py) against HF transformers' OlmoHybridForCausalLM, in float32.

HF runs its pure-PyTorch chunked delta rule (chunks of 64) on CPU; our sequences are longer
than two chunks and run at our default chunk of 64 and at 16.

The reference is HF in float64. These random models sit near float32's noise floor (the
delta rule with beta up to 2 and a 0.2 init amplify rounding): HF's own float32 logits are
1.1e-5 .. 2.3e-5 (relative to the largest) from its float64 ones, its gradients up to 2.4e-5.
So ours (float32) must be within 1e-5 of HF float64, or within 1.5x of HF float32's own
distance from it where that is larger: as close to the truth as HF's float32 path is. As tests/test_model_parity.py:
a random HF model (norm weights perturbed away from 1) written with `save_pretrained`, read
with `load_hf`; logits, loss, every gradient, the round trip, greedy generation. HF's PyTorch
path has no packed documents, so a packed row is checked against HF on each document alone.
"""

import copy
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from olmo_eqx import load_hf, save_hf, with_config
from olmo_eqx.interop.generate import generate
from olmo_eqx.interop.hf import hf_state_dict

VOCAB = 200
SEQ = 140  # > 2 chunks of 64
BATCH = 2
INIT_STD = 0.2


@dataclasses.dataclass(frozen=True)
class Case:
    rope: bool = True
    key_heads: int = 2
    n_layers: int = 4
    neg_eigval: bool = True

    @property
    def id(self) -> str:
        return f"{'rope' if self.rope else 'nope'}-k{self.key_heads}-{self.n_layers}l{'' if self.neg_eigval else '-posbeta'}"


CASES = [Case(), Case(rope=False, key_heads=4, n_layers=8, neg_eigval=False)]


def build_hf_model(case: Case, seed: int = 0) -> transformers.PreTrainedModel:
    config = transformers.OlmoHybridConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=case.n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=case.key_heads,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_allow_neg_eigval=case.neg_eigval,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=INIT_STD,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0 if case.rope else None},
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.OlmoHybridForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def pair(request, tmp_path_factory):
    case = request.param
    hf_model = build_hf_model(case)
    directory = tmp_path_factory.mktemp(case.id)
    hf_model.save_pretrained(directory)
    ours = load_hf(directory)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ))
    return case, hf_model, ours, tokens


def torch_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.as_tensor(tokens)).logits.numpy()


def assert_as_close_as_hf_float32(ours, hf32, hf64, what):
    scale = np.abs(hf64).max()
    ours_err, hf_err = np.abs(ours - hf64).max() / scale, np.abs(hf32 - hf64).max() / scale
    print(f"{what}: ours {ours_err:.2e} from HF float64 (HF float32 {hf_err:.2e}; ours from HF float32 "
          f"{np.abs(ours - hf32).max() / scale:.2e})")
    assert ours_err <= max(1e-5, 1.5 * hf_err), what


def hf_grads_by_file_name(hf_model) -> dict[str, np.ndarray]:
    """HF's gradients under the checkpoint files' tensor names: transformers renames two norms
    and fuses the q/k/v convolutions into one conv1d in memory (its conversion mapping)."""
    config = hf_model.config
    key_features = config.linear_num_key_heads * config.linear_key_head_dim
    grads = {}
    for name, p in hf_model.named_parameters():
        g = p.grad.numpy()
        if name.endswith("linear_attn.conv1d.weight"):
            prefix = name.removesuffix("conv1d.weight")
            parts = np.split(g, [key_features, 2 * key_features], axis=0)
            grads.update({f"{prefix}{c}_conv1d.weight": part for c, part in zip("qkv", parts)})
            continue
        name = name.replace("input_layernorm", "attention_layer_norm").replace("post_attention_layernorm",
                                                                                "feedforward_layer_norm")
        grads[name] = g
    return grads


def mean_next_token_loss(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


@eqx.filter_jit
def our_logits(model, tokens, positions=None, segment_ids=None):
    return model(tokens, positions, segment_ids=segment_ids)


def test_config_read_from_hf(pair):
    case, hf_model, ours, _ = pair
    config = ours.config
    assert config.architecture == "olmo_hybrid" and config.layer_pattern == ("gdn", "gdn", "gdn", "attention")
    assert config.cycle_length == 4 and config.n_layers == case.n_layers
    assert (config.gdn_heads, config.gdn_key_heads, config.gdn_key_dim, config.gdn_value_dim) == (4, case.key_heads, 16, 24)
    assert config.use_rope == case.rope and config.gdn_allow_neg_eigval == case.neg_eigval
    assert config.layer_types == list(hf_model.config.layer_types)


def test_logits_match_pytorch(pair):
    case, hf_model, ours, tokens = pair
    hf32, hf64 = torch_logits(hf_model, tokens), torch_logits(copy.deepcopy(hf_model).double(), tokens)
    for chunk in (64, 16):
        got = np.asarray(our_logits(with_config(ours, gdn_chunk_size=chunk), jnp.asarray(tokens)))
        assert_as_close_as_hf_float32(got, hf32, hf64, f"{case.id} chunk {chunk}")
    # These small models loop over their cycles in Python; large ones scan them (the 8-layer case:
    # two cycles).
    if ours.config.n_layers // ours.config.cycle_length > 1:
        assert not ours.config.scanned
        scanned = np.asarray(our_logits(with_config(ours, scan_layers=True), jnp.asarray(tokens)))
        assert_as_close_as_hf_float32(scanned, hf32, hf64, f"{case.id} with its cycles scanned")


def test_packed_documents_match_pytorch_on_each_document(pair):
    """Row 0 packs three documents (positions restarting at each): its logits equal HF's on each
    document alone; a wrong reset (of the state or of the convolution) would show."""
    case, hf_model, ours, tokens = pair
    cuts = [0, 50, 101, SEQ]  # the second document starts mid-chunk, both span chunk edges
    segment_ids = np.zeros((BATCH, SEQ), np.int32)
    positions = np.tile(np.arange(SEQ), (BATCH, 1))
    for d, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        segment_ids[0, a:b] = d
        positions[0, a:b] = np.arange(b - a)
    got = np.asarray(our_logits(ours, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)))
    hf64_model = copy.deepcopy(hf_model).double()
    per_document = lambda m: np.concatenate(  # noqa: E731
        [torch_logits(m, tokens[:1, a:b]) for a, b in zip(cuts[:-1], cuts[1:])], axis=1
    )
    expected = per_document(hf64_model)
    assert_as_close_as_hf_float32(got[:1], per_document(hf_model), expected, f"{case.id} packed")
    assert_as_close_as_hf_float32(got[1:], torch_logits(hf_model, tokens[1:]), torch_logits(hf64_model, tokens[1:]),
                                  f"{case.id} unpacked row")
    scale = np.abs(expected).max()
    unmasked = np.asarray(our_logits(ours, jnp.asarray(tokens), jnp.asarray(positions)))
    assert np.abs(unmasked[:1] - expected).max() > 100 * 1e-5 * scale


def hf_loss_and_grads(hf_model, tokens, dtype):
    model = copy.deepcopy(hf_model).to(dtype)
    out = model(torch.as_tensor(tokens), labels=torch.as_tensor(tokens))
    out.loss.backward()
    return out.loss.item(), {k: v.astype(np.float64) for k, v in hf_grads_by_file_name(model).items()}


def test_loss_and_gradients_match_pytorch(pair):
    """All gradients together within 1e-5 (relative norm) of HF's in float64 (or 1.5x HF float32's own
    distance from it, where larger); each one within
    1e-5 too, or, where float32 itself cannot get that close, within 3x of the distance of
    HF's own float32 gradient from float64 (HF float32 is up to 2.4e-5 off on the delta rule's
    decay parameters A_log and dt_bias, one number per head summing many cancelling terms over
    the sequence; ours up to 5.1e-5 there)."""
    case, hf_model, ours, tokens = pair
    hf_loss, hf32 = hf_loss_and_grads(hf_model, tokens, torch.float32)
    _, hf64 = hf_loss_and_grads(hf_model, tokens, torch.float64)
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t: mean_next_token_loss(m(t), t)))(
        ours, jnp.asarray(tokens)
    )
    assert abs(float(loss) - hf_loss) <= 1e-6 * abs(hf_loss)
    our_grads = {name: np.asarray(g, np.float64) for name, g in hf_state_dict(grads).items()}
    assert set(our_grads) == set(hf64)
    relative = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    worst, worst_hf, worst_vs_hf32 = 0.0, 0.0, 0.0
    for name, truth in hf64.items():
        ours_err, hf_err = relative(our_grads[name], truth), relative(hf32[name], truth)
        worst, worst_hf = max(worst, ours_err), max(worst_hf, hf_err)
        worst_vs_hf32 = max(worst_vs_hf32, relative(our_grads[name], hf32[name]))
        assert ours_err <= max(1e-5, 3 * hf_err), f"{case.id}: gradient of {name}: {ours_err:.2e} from float64 (HF float32: {hf_err:.2e})"
    flat = lambda g: np.concatenate([g[name].ravel() for name in sorted(hf64)])  # noqa: E731
    overall, overall_hf = relative(flat(our_grads), flat(hf64)), relative(flat(hf32), flat(hf64))
    print(f"{case.id}: all gradients together: ours {overall:.2e} from HF float64, HF float32 {overall_hf:.2e}")
    assert overall <= max(1e-5, 1.5 * overall_hf)
    print(f"{case.id}: worst relative gradient difference from HF float64 {worst:.2e} (HF float32 {worst_hf:.2e}); "
          f"from HF float32 {worst_vs_hf32:.2e}")


def test_save_hf_roundtrip(pair, tmp_path):
    case, hf_model, ours, tokens = pair
    save_hf(ours, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded) is transformers.OlmoHybridForCausalLM
    assert list(reloaded.config.layer_types) == list(hf_model.config.layer_types)
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), hf_model.state_dict().items()):
        assert torch.equal(a, b), name
    again = load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(ours)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.config.replace(rope_theta=0.0) == ours.config.replace(rope_theta=0.0)


def test_greedy_generate_matches_pytorch(pair):
    case, hf_model, ours, tokens = pair
    prompts = tokens[:, :70]  # the prefill spans a chunk edge
    with torch.no_grad():
        expected = hf_model.generate(torch.as_tensor(prompts), max_new_tokens=8, do_sample=False).numpy()[:, 70:]
    assert generate(ours, prompts, 8) == expected.tolist()


def test_flops_and_parameters_of_the_released_7b():
    """Olmo-Hybrid-7B: every parameter is a matmul weight, the embedding or a norm/decay vector;
    the GDN layers' kernel FLOPs do not grow with the sequence, the attention layers' do."""
    from olmo_eqx import ZOO, count_params
    from olmo_eqx.models.flops import attention_flops_per_token, gdn_flops_per_token, matmul_params

    config = ZOO["olmo_hybrid_7b"]
    n_gdn, n_attention = 24, 8
    assert config.layer_types.count("linear_attention") == n_gdn and config.cycle_length == 4
    d, h = config.d_model, config.gdn_heads
    vectors = n_gdn * (2 * d + config.gdn_value_dim + 2 * h) + n_attention * (2 * d + 2 * config.n_heads * config.head_dim) + d
    assert count_params(config) == matmul_params(config) + config.padded_vocab_size * d + vectors
    assert 7.3e9 < count_params(config) < 7.5e9
    growth = attention_flops_per_token(config, 65_536) - attention_flops_per_token(config, 8192)
    assert growth == n_attention * 12 * config.n_heads * config.head_dim * (65_536 - 8192)
    assert gdn_flops_per_token(config) == 6 * h * (64 * (2 * 96 + (96 + 192) // 2 + 192) + 3 * 96 * 192)
