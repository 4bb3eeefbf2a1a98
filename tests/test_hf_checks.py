"""What `load_hf` refuses before any stage uses it (issue 50, rows 11-12): a config.json whose
sizes are not whole numbers >= 1 (one line naming the field, its value and what it must be),
and weights holding nan or inf (one line naming the tensor); exit status 2 in every stage."""

import json
import shutil

import jax
import numpy as np
import pytest

from olmo_eqx import load_hf
from olmo_eqx.interop.hf import HFCheckpointError, save_hf
from olmo_eqx.models.registry import build_model
from olmo_eqx.config import compose_config

from clihelp import olmo_eqx, xla_flags


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The nano model, saved as a HF directory (float32)."""
    out = tmp_path_factory.mktemp("hf") / "nano"
    save_hf(build_model(compose_config(["model=olmo3_nano"]).model, key=jax.random.key(0)), out, dtype="float32")
    return out


def with_config(hf_dir, tmp_path, name, **changes):
    """A copy of `hf_dir` whose config.json has `changes` (None: the field removed)."""
    out = tmp_path / name
    shutil.copytree(hf_dir, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


def with_nan(hf_dir, tmp_path, tensor):
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "nan"
    shutil.copytree(hf_dir, out)
    (file,) = out.glob("*.safetensors")
    tensors = load_file(str(file))
    tensors[tensor] = tensors[tensor].copy()
    tensors[tensor][0, 0] = np.nan
    tensors[tensor][-1, -1] = np.inf
    save_file(tensors, str(file), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "changes, said",
    [
        ({"num_hidden_layers": "four"}, '"num_hidden_layers" is "four"; it must be a whole number >= 1'),
        ({"num_attention_heads": 0}, '"num_attention_heads" is 0; it must be a whole number >= 1'),
        ({"intermediate_size": 64.5}, '"intermediate_size" is 64.5; it must be a whole number >= 1'),
        ({"vocab_size": True}, '"vocab_size" is true; it must be a whole number >= 1'),
        ({"hidden_size": None}, 'has no "hidden_size"'),
        ({"num_key_value_heads": 3}, '"num_key_value_heads" is 3; it must be a divisor of num_attention_heads'),
        ({"rms_norm_eps": -1e-6}, '"rms_norm_eps" is -1e-06; it must be a finite number > 0'),
        ({"max_position_embeddings": -5}, '"max_position_embeddings" is -5; it must be a whole number >= 1'),
    ],
)
def test_load_hf_names_a_bad_config_field(hf_dir, tmp_path, changes, said):
    bad = with_config(hf_dir, tmp_path, "bad", **changes)
    with pytest.raises(HFCheckpointError) as refused:
        load_hf(bad)
    assert said in str(refused.value) and str(bad / "config.json") in str(refused.value)
    assert "\n" not in str(refused.value)


def test_load_hf_names_a_tensor_holding_nan_or_inf(hf_dir, tmp_path):
    load_hf(hf_dir)  # the unchanged copy loads
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(HFCheckpointError, match=rf"tensor '{name}' holds 2 nan/inf value\(s\)"):
        load_hf(with_nan(hf_dir, tmp_path, name))


@pytest.mark.parametrize(
    "stage, fault, said",
    [
        ("eval", "four", '"num_hidden_layers" is "four"'),
        ("generate", "nan", "nan/inf value(s)"),
        ("anneal", "zero_heads", '"num_attention_heads" is 0'),
    ],
)
def test_every_stage_that_loads_hf_stops_in_one_line(hf_dir, tmp_path, stage, fault, said):
    faults = {
        "four": lambda: with_config(hf_dir, tmp_path, "four", num_hidden_layers="four"),
        "zero_heads": lambda: with_config(hf_dir, tmp_path, "zero", num_attention_heads=0),
        "nan": lambda: with_nan(hf_dir, tmp_path, "model.embed_tokens.weight"),
    }
    source = faults[fault]()
    result = olmo_eqx(f"+stage={stage}", "model=olmo3_nano", f"checkpoint.load={source}",
                      f"hydra.run.dir={tmp_path / 'out'}", env={"XLA_FLAGS": xla_flags(1)})
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("error: ") and said in lines[-1], result.stderr
    assert not (tmp_path / "out").exists()
