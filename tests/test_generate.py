"""Generation with a KV cache against HF transformers' generate and against full forward passes.

The HF model is built locally with random weights (float32) and a sliding window of 8, so
prompts plus 20 new tokens cross the window boundary several times; our model reads the same
weights through `load_hf`. HF generates each prompt alone (no padding); ours runs them as one
left-padded batch, so positions and padding masks are tested too.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import olmo_eqx
from olmo_eqx import load_hf
from olmo_eqx.interop.generate import decode_step, left_pad, prefill

WINDOW = 8
NEW = 20
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [7, 3], [150, 2, 99, 42, 42, 8], [64]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    config = transformers.Olmo3Config(
        vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2,
        sliding_window=WINDOW, pad_token_id=None, eos_token_id=None, bos_token_id=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500_000.0}},
    )
    torch.manual_seed(0)
    hf = transformers.Olmo3ForCausalLM(config).float().eval()
    directory = tmp_path_factory.mktemp("olmo3-window8")
    hf.save_pretrained(directory)
    return hf, load_hf(directory)


def test_greedy_matches_hf_generate_across_the_window(models):
    hf, ours = models
    got = olmo_eqx.generate(ours, PROMPTS, NEW)
    for prompt, tokens in zip(PROMPTS, got):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
        assert tokens == expected[0, len(prompt):].tolist(), f"prompt {prompt}"
        assert len(prompt) + NEW > 2 * WINDOW or len(prompt) == 13


def test_decode_step_logits_equal_a_full_forward(models):
    """Every cached step (prefill, then 14 decode steps past the window) against model(prefix)."""
    _, ours = models
    tokens, start = left_pad(PROMPTS)
    cache, logits = prefill(ours, jnp.asarray(tokens), jnp.asarray(start), tokens.shape[1] + 16)
    sequences = [list(p) for p in PROMPTS]
    width = max(map(len, PROMPTS)) + 15
    # One compiled forward: right padding changes nothing before a row's last real token.
    forward = jax.jit(lambda t: ours(t))
    worst = 0.0
    for step in range(15):
        padded = np.zeros((len(PROMPTS), width), np.int32)
        for row, sequence in enumerate(sequences):
            padded[row, : len(sequence)] = sequence
        full_logits = np.asarray(forward(jnp.asarray(padded)))
        for row, sequence in enumerate(sequences):
            full = full_logits[row, len(sequence) - 1]
            worst = max(worst, float(np.abs(np.asarray(logits[row]) - full).max() / np.abs(full).max()))
        nxt = [(37 * step + 11 * row) % 200 for row in range(len(PROMPTS))]
        for row, token in enumerate(nxt):
            sequences[row].append(token)
        cache, logits = decode_step(ours, cache, jnp.asarray(nxt, jnp.int32))
    print(f"cached vs full forward: max |dlogits| / max |logits| = {worst:.2e}")
    assert worst <= 1e-5


def test_sliding_layers_keep_only_their_window(models):
    _, ours = models
    tokens, start = left_pad(PROMPTS)
    sizes = []
    for new in (16, 64):
        cache, _ = prefill(ours, jnp.asarray(tokens), jnp.asarray(start), tokens.shape[1] + new)
        sizes.append([k.shape[2] for k in cache.keys])
    # Cycle positions 0-2 are sliding (ring of WINDOW slots), 3 is full (grows with the length).
    assert sizes[0][:3] == sizes[1][:3] == [WINDOW] * 3
    assert sizes[1][3] - sizes[0][3] == 48


def test_sampling_stop_ids_and_errors(models):
    _, ours = models
    greedy = olmo_eqx.generate(ours, PROMPTS, 6)
    key = jax.random.key(1)
    # top_k=1 leaves only the argmax, whatever the temperature.
    assert olmo_eqx.generate(ours, PROMPTS, 6, temperature=2.0, top_k=1, key=key) == greedy
    sampled = olmo_eqx.generate(ours, PROMPTS, 6, temperature=1.0, top_p=0.9, key=key)
    assert sampled == olmo_eqx.generate(ours, PROMPTS, 6, temperature=1.0, top_p=0.9, key=key)  # the key decides
    # A stop id ends its row (kept as the last token); other rows go on.
    stop = greedy[0][2]
    stopped = olmo_eqx.generate(ours, PROMPTS, 6, stop_ids=[stop])
    assert stopped[0] == greedy[0][: greedy[0].index(stop) + 1]
    for row, tokens in zip(greedy[1:], stopped[1:]):
        assert tokens == (row[: row.index(stop) + 1] if stop in row else row)
    with pytest.raises(ValueError, match="key"):
        olmo_eqx.generate(ours, PROMPTS, 2, temperature=1.0)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        olmo_eqx.generate(ours, [[5, 999]], 2)


def test_sharded_generation_on_8_devices_gives_the_same_tokens(models):
    from olmo_eqx.sharding import MeshConfig, make_mesh, model_shardings

    _, ours = models
    mesh = make_mesh(MeshConfig())
    assert mesh.size == 8
    placed = jax.device_put(ours, model_shardings(ours, mesh))
    # 4 prompts on 8 batch shards: padded with dummy rows, which never come back.
    assert olmo_eqx.generate(placed, PROMPTS, 6, mesh=mesh) == olmo_eqx.generate(ours, PROMPTS, 6)


def test_generate_stage_prints_and_writes_completions(tmp_path_factory, tmp_path):
    """`+stage=generate` on a pretrain run: prompts from the command line and a JSONL file (an
    empty one starts from EOS), decoded with the run's tokenizer, equal to the library's greedy."""
    from clihelp import olmo_eqx as cli, xla_flags
    from evalhelp import tiny_run
    from olmo_eqx.evaluation import TextTokenizer, load_model, locate
    from olmo_eqx.sharding import MeshConfig, make_mesh

    run = tiny_run(tmp_path_factory)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "import os\n"}) + "\n" + json.dumps("") + "\n")
    out = tmp_path / "out"
    result = cli("+stage=generate", f"checkpoint.load={run}", 'stage.prompts=["def f(x):\\n    return"]',
                 f"stage.prompts_file={prompts_file}", "stage.max_new_tokens=8", f"hydra.run.dir={out}",
                 env={"XLA_FLAGS": xla_flags(1)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.match(r"^cluster: local( \(TPU_WORKER_HOSTNAMES lists one host\))?, 1 process x 1 cpu device, mesh ", (out / "generate.log").read_text())
    written = json.loads((out / "generations.json").read_text())
    prompts = [c["prompt"] for c in written["completions"]]
    assert prompts == ["def f(x):\n    return", "import os\n", ""]
    assert written["step"] == 12 and all(c["new_tokens"] <= 8 for c in written["completions"])
    for c in written["completions"]:
        assert c["prompt"] + c["completion"] in result.stdout

    model = load_model(locate(str(run)), make_mesh(MeshConfig(), devices=jax.devices()[:1]))
    tokenizer = TextTokenizer(written["tokenizer"])
    ids = [i or [tokenizer.eos_id] for i in tokenizer.encode_batch(prompts)]
    expected = olmo_eqx.generate(model, ids, 8, stop_ids=[tokenizer.eos_id])
    assert [c["completion"] for c in written["completions"]] == [tokenizer.decode(t) for t in expected]

    missing = cli("+stage=generate", f"hydra.run.dir={tmp_path / 'none'}")
    assert missing.returncode == 2 and "checkpoint.load=<run dir" in missing.stderr
