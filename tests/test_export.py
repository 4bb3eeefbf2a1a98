"""`+stage=export` and `olmo_eqx.export_hf`: a run of ours in, a HF directory out that
transformers (model and tokenizer) and `olmo_eqx.load_hf` load, with the run's special tokens."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from olmo_eqx import export_hf, load_hf
from olmo_eqx.data.embedded import embedded_corpus
from olmo_eqx.evaluation.tokens import TextTokenizer
from olmo_eqx.interop.export import check_export_dir
from olmo_eqx.sharding import MeshConfig, make_mesh
from olmo_eqx.stages import StageError
from olmo_eqx.warm_start import load_model, locate

from clihelp import olmo_eqx
from evalhelp import tiny_run


def umask_mode() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return 0o666 & ~current


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The command line's export of the tiny run (its latest step, 12)."""
    run = tiny_run(tmp_path_factory)
    out = tmp_path_factory.mktemp("export") / "hf"
    result = olmo_eqx("+stage=export", f"checkpoint.load={run}", f"hydra.run.dir={out}")
    assert result.returncode == 0, result.stdout + result.stderr
    return run, out, result


def test_export_writes_a_hf_dir_with_the_runs_tokens(exported):
    _, out, result = exported
    corpus = embedded_corpus()
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for ids in (config, generation):
        assert ids["eos_token_id"] == corpus.eos_id and ids["pad_token_id"] == corpus.pad_id
        assert ids["bos_token_id"] is None  # OLMo adds no BOS
    assert (out / "tokenizer.json").read_bytes() == corpus.tokenizer_path.read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    # The weights are as readable as every other file written (safetensors alone made them 0600).
    assert (out / "model.safetensors").stat().st_mode & 0o777 == umask_mode()
    assert "export:" in result.stdout and json.loads((out / "summary.json").read_text())["step"] == 12


def test_export_loads_in_transformers_and_olmo_eqx(exported):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    run, out, _ = exported
    ours = load_model(locate(str(run)), make_mesh(MeshConfig()))
    back = load_hf(out, padded_vocab_size=ours.config.padded_vocab_size)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    text = "def fibonacci(n):\n    return n"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = TextTokenizer(out / "tokenizer.json").encode_batch([text])[0]
    assert tokenizer(text)["input_ids"] == ids  # no BOS added
    assert tokenizer.eos_token_id == embedded_corpus().eos_id and tokenizer.pad_token_id == embedded_corpus().pad_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    expected = np.asarray(ours(jax.numpy.asarray([ids])))[0, :, : theirs.shape[-1]]
    np.testing.assert_allclose(theirs, expected, atol=2e-4, rtol=1e-4)


def test_export_hf_takes_a_run_dir_and_a_step_dir(exported, tmp_path):
    run, out, _ = exported
    whole = export_hf(run, tmp_path / "latest")
    assert whole["step"] == 12 and whole["tokenizer"] is not None
    assert (tmp_path / "latest" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert export_hf(run / "checkpoints" / "6", tmp_path / "six")["step"] == 6


def test_export_refuses_what_is_not_our_checkpoint_in_one_line(exported, tmp_path):
    _, out, _ = exported
    result = olmo_eqx("+stage=export", f"checkpoint.load={out}", f"hydra.run.dir={tmp_path / 'again'}")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "checkpoint.load=" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    result = olmo_eqx("+stage=export", f"hydra.run.dir={tmp_path / 'none'}")
    assert result.returncode == 2 and "checkpoint.load=" in result.stderr, result.stderr


def _contents(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_refuses_a_non_empty_dir_and_a_run_dir_leaving_them_as_they_were(exported, tmp_path):
    run, _, _ = exported
    mine = tmp_path / "mine"
    (mine / ".hydra").mkdir(parents=True)
    (mine / "config.json").write_text('{"model_type": "llama", "mine": true}\n')
    (mine / "model-00002-of-00002.safetensors").write_bytes(b"shard")
    (mine / ".hydra" / "overrides.yaml").write_text("- mine=1\n")
    before = _contents(mine)
    result = olmo_eqx("+stage=export", f"checkpoint.load={run}", f"hydra.run.dir={mine}")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "is not empty" in result.stderr and "stage.overwrite=true" in result.stderr, result.stderr
    assert _contents(mine) == before  # .hydra/ too: Hydra rewrote it, the refusal put it back

    # A training run's own directory, even when told to overwrite (a copy: the shared run is read only).
    training = tmp_path / "run"
    shutil.copytree(run, training)
    (training / ".hydra").mkdir(exist_ok=True)
    (training / ".hydra" / "overrides.yaml").write_text("- +stage=pretrain\n")
    before = _contents(training)
    result = olmo_eqx("+stage=export", f"checkpoint.load={training}", f"hydra.run.dir={training}",
                      "stage.overwrite=true")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "training run's directory" in result.stderr and "hydra.run.dir=" in result.stderr, result.stderr
    assert _contents(training) == before


def test_export_overwrite_takes_a_non_empty_dir_but_never_a_run_dir(exported, tmp_path):
    run, out, _ = exported
    check_export_dir(tmp_path / "new")
    check_export_dir(out, overwrite=True)  # a previous export
    with pytest.raises(StageError, match="is not empty.*stage.overwrite=true"):
        check_export_dir(out)
    (tmp_path / "only_hydra" / ".hydra").mkdir(parents=True)
    check_export_dir(tmp_path / "only_hydra")  # what Hydra wrote before the stage ran
    for overwrite in (False, True):
        with pytest.raises(StageError, match="training run's directory"):
            check_export_dir(run, overwrite=overwrite)
    with pytest.raises(StageError, match="out_dir=.*not empty"):
        export_hf(run, out)
