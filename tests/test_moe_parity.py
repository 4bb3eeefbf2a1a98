"""OLMoE and FlexOlmo (olmoe.py) against HF transformers' OlmoeForCausalLM / FlexOlmoForCausalLM.

As tests/test_model_parity.py: a random float32 HF model (norm weights perturbed away from 1),
written with `save_pretrained`, read with `load_hf`; logits, loss, every gradient, the router's
auxiliary losses, the round trip back to HF and greedy generation compared.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

from olmo_eqx import load_hf, save_hf, with_config
from olmo_eqx.interop.generate import generate
from olmo_eqx.interop.hf import hf_state_dict

VOCAB = 200  # not a multiple of 128: padding is exercised
SEQ = 24
BATCH = 2
EXPERTS = 8
EXPERT_HIDDEN = 32


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # "olmoe" or "flex_olmo"
    n_kv_heads: int = 4
    top_k: int = 2
    norm_topk_prob: bool = False
    clip_qkv: float | None = None

    @property
    def id(self) -> str:
        extras = [f"kv{self.n_kv_heads}", f"top{self.top_k}"]
        extras += ["norm_topk"] if self.norm_topk_prob else []
        extras += [f"clip{self.clip_qkv}"] if self.clip_qkv else []
        return "-".join([self.family, *extras])


CASES = [
    Case("olmoe"),
    Case("olmoe", n_kv_heads=2, top_k=3, norm_topk_prob=True, clip_qkv=1.5),
    Case("flex_olmo"),
]


def build_hf_model(case: Case, seed: int = 0) -> transformers.PreTrainedModel:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=EXPERT_HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=case.n_kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        initializer_range=0.2,  # logits far from zero, routing far from uniform
        num_experts=EXPERTS,
        num_experts_per_tok=case.top_k,
        norm_topk_prob=case.norm_topk_prob,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    if case.family == "olmoe":
        config, cls = transformers.OlmoeConfig(clip_qkv=case.clip_qkv, **common), transformers.OlmoeForCausalLM
    else:
        config, cls = transformers.FlexOlmoConfig(**common), transformers.FlexOlmoForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def pair(request, tmp_path_factory):
    """(case, HF model, our model loaded from its checkpoint, token batch)."""
    case = request.param
    hf_model = build_hf_model(case)
    directory = tmp_path_factory.mktemp(case.id)
    hf_model.save_pretrained(directory)
    ours = load_hf(directory)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ))
    return case, hf_model, ours, tokens


@eqx.filter_jit
def our_logits(model, tokens):
    return model(tokens)


def mean_next_token_loss(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def hf_grads_by_checkpoint_name(hf_model) -> dict[str, np.ndarray]:
    """HF's gradients under the checkpoint's tensor names: transformers fuses each layer's
    experts into gate_up_proj [E, 2I, d] and down_proj [E, d, I] in memory, the files hold one
    tensor per expert."""
    grads = {}
    for name, p in hf_model.named_parameters():
        g = p.grad.numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e in range(g.shape[0]):
                grads[f"{prefix}{e}.gate_proj.weight"] = g[e, :EXPERT_HIDDEN]
                grads[f"{prefix}{e}.up_proj.weight"] = g[e, EXPERT_HIDDEN:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(g.shape[0]):
                grads[f"{prefix}{e}.down_proj.weight"] = g[e]
        else:
            grads[name] = g
    return grads


def test_config_read_from_hf(pair):
    case, _, ours, _ = pair
    config = ours.config
    assert config.architecture == case.family and config.n_experts == EXPERTS
    assert config.n_experts_per_token == case.top_k and config.norm_topk_prob == case.norm_topk_prob
    assert config.clip_qkv == case.clip_qkv and config.sliding_window is None
    assert config.padded_vocab_size == 256 and config.mlp_hidden == EXPERT_HIDDEN


def test_logits_match_pytorch(pair):
    case, hf_model, ours, tokens = pair
    with torch.no_grad():
        expected = hf_model(torch.as_tensor(tokens)).logits.numpy()
    scale = np.abs(expected).max()
    for impl in ("dropless", "dense"):
        got = np.asarray(our_logits(with_config(ours, moe_impl=impl), jnp.asarray(tokens)))
        err = np.abs(got - expected).max()
        print(f"{case.id} {impl}: max|dlogits|/max|logits| = {err / scale:.2e}")
        assert err <= 1e-5 * scale


def test_loss_and_gradients_match_pytorch(pair):
    case, hf_model, ours, tokens = pair
    hf_model.zero_grad()
    out = hf_model(torch.as_tensor(tokens), labels=torch.as_tensor(tokens))
    out.loss.backward()
    torch_grads = hf_grads_by_checkpoint_name(hf_model)
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t: mean_next_token_loss(m(t), t)))(
        ours, jnp.asarray(tokens)
    )
    assert abs(float(loss) - out.loss.item()) <= 1e-6 * abs(out.loss.item())
    our_grads = {name: np.asarray(g) for name, g in hf_state_dict(grads).items()}
    assert set(our_grads) == set(torch_grads)
    worst = 0.0
    for name, expected in torch_grads.items():
        norm = np.linalg.norm(expected)
        if norm == 0:  # an expert no token chose gets no gradient, on both sides
            assert np.all(our_grads[name] == 0), name
            continue
        ratio = np.linalg.norm(our_grads[name] - expected) / norm
        worst = max(worst, ratio)
        assert ratio <= 1e-5, f"{case.id}: gradient of {name} differs by {ratio:.2e} (relative)"
    print(f"{case.id}: worst relative gradient difference {worst:.2e}")


def test_router_losses_match_pytorch(pair):
    """Our per-layer load-balancing loss is HF's `load_balancing_loss_func` on that layer alone
    divided by k (HF counts k assignments per token, so balance gives k); the z-loss is the
    mean squared logsumexp of HF's router logits."""
    case, hf_model, ours, tokens = pair
    with torch.no_grad():
        router_logits = hf_model(torch.as_tensor(tokens), output_router_logits=True).router_logits
    hf_balance = np.mean([load_balancing_loss_func((lg,), EXPERTS, case.top_k).item() for lg in router_logits])
    hf_z = np.mean([torch.logsumexp(lg, dim=-1).square().mean().item() for lg in router_logits])
    _, aux = eqx.filter_jit(lambda m, t: m.hidden_states_and_aux(t))(ours, jnp.asarray(tokens))
    np.testing.assert_allclose(float(aux["router_load_balance"]), hf_balance / case.top_k, rtol=1e-5)
    np.testing.assert_allclose(float(aux["router_z_loss"]), hf_z, rtol=1e-5)
    config = ours.config
    weighted = config.router_aux_loss_coef * hf_balance / case.top_k + config.router_z_loss_coef * hf_z
    np.testing.assert_allclose(float(aux["aux_objective"]), weighted, rtol=1e-5)
    assert float(aux["moe_dropped_tokens"]) == 0.0
    assert all(float(aux[f"moe_max_load/layer_{i}"]) >= 1.0 for i in range(config.n_layers))


def test_save_hf_roundtrip(pair, tmp_path):
    """Ours -> HF files -> transformers gives the same logits; HF files -> ours -> HF files is exact."""
    case, hf_model, ours, tokens = pair
    save_hf(ours, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded) is type(hf_model)
    with torch.no_grad():
        np.testing.assert_array_equal(
            reloaded(torch.as_tensor(tokens)).logits.numpy(), hf_model(torch.as_tensor(tokens)).logits.numpy()
        )
    again = load_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(ours)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.config == ours.config


def test_greedy_generate_matches_pytorch(pair):
    case, hf_model, ours, tokens = pair
    prompts = tokens[:, :10]
    with torch.no_grad():
        expected = hf_model.generate(torch.as_tensor(prompts), max_new_tokens=8, do_sample=False).numpy()[:, 10:]
    got = generate(ours, prompts, 8)
    assert got == expected.tolist()


def test_dropless_gradients_equal_the_dense_reference(pair):
    case, _, ours, tokens = pair

    def loss(m, t):
        hidden, aux = m.hidden_states_and_aux(t)
        return mean_next_token_loss(m.logits(hidden), t) + aux["aux_objective"]

    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = grad_fn(ours, jnp.asarray(tokens))
    dense_value, dense_grads = grad_fn(with_config(ours, moe_impl="dense"), jnp.asarray(tokens))
    np.testing.assert_allclose(float(value), float(dense_value), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-30)


def test_flops_count_the_active_experts_and_memory_all_of_them():
    """OLMoE-1B-7B: 6.92B parameters, about 1.3B of them active per token (its model card)."""
    from olmo_eqx import ZOO, count_params
    from olmo_eqx.models.flops import matmul_params, total_matmul_params

    config = ZOO["olmoe_1b_7b"]
    embedding = config.padded_vocab_size * config.d_model
    norms = config.n_layers * 4 * config.d_model + config.d_model  # 2 block norms, q/k norms (full width), final
    assert count_params(config) == total_matmul_params(config) + embedding + norms == 6_919_161_856
    active = matmul_params(config) + embedding
    assert 1.25e9 < active < 1.35e9
    expert_mlp = 3 * config.d_model * config.mlp_hidden
    assert total_matmul_params(config) - matmul_params(config) == config.n_layers * (
        config.n_experts - config.n_experts_per_token
    ) * expert_mlp
