"""Data is what was meant (issue 50, rows 1-8): every input that used to train, or crash,
silently on the wrong data is refused in one line naming the input and the fix."""

import numpy as np
import pytest

from olmo_eqx.data.config import DataConfig
from olmo_eqx.data.sources import check_against_model
from olmo_eqx.data.token_files import DataFileError
from olmo_eqx.interop.generate import check_prompt_lengths

from clihelp import TINY, olmo_eqx


# Row 6: an EOS id outside the vocabulary is never found: document masking would mask nothing.
@pytest.mark.parametrize("eos", [99999, -1, 4096])
def test_eos_outside_the_vocab_with_document_masking_is_refused(eos):
    data = DataConfig(document_masking=True, eos_token_id=eos)
    with pytest.raises(DataFileError, match=rf"data.eos_token_id={eos} is outside .*\[0, 4096\).*set data.eos_token_id"):
        check_against_model(data, 4096, 1024)


def test_eos_is_only_checked_when_documents_are_masked_and_the_default_is_checked_too():
    check_against_model(DataConfig(eos_token_id=99999), 4096, 1024)  # unused without document masking
    check_against_model(DataConfig(document_masking=True, eos_token_id=4095), 4096, 1024)
    check_against_model(DataConfig(document_masking=True), 4096, 1024)  # the embedded corpus' own EOS
    # Token files with the default EOS (dolma2's 100257) and a small vocab: no boundary either.
    with pytest.raises(DataFileError, match="the default EOS id"):
        check_against_model(DataConfig(source="x/*.npy", document_masking=True), 60000, 1024)


# Row 8: a sequence longer than the model's context.
def test_sequence_longer_than_the_model_is_refused():
    check_against_model(DataConfig(sequence_length=1024), 4096, 1024)
    with pytest.raises(DataFileError, match=r"data.sequence_length=1025 is above the model's max_sequence_length=1024"):
        check_against_model(DataConfig(sequence_length=1025), 4096, 1024)


def test_a_prompt_plus_new_tokens_longer_than_the_model_names_the_prompts_length():
    check_prompt_lengths([10, 1000], 24, 1024)
    with pytest.raises(ValueError, match=r"prompt 2 is 1001 tokens: with max_new_tokens=24 .*1025 tokens.*max_new_tokens<=23"):
        check_prompt_lengths([10, 1001], 24, 1024)


def test_cli_refuses_a_long_sequence_in_one_line_and_leaves_no_run_dir(tmp_path):
    run_dir = tmp_path / "outputs" / "run"
    result = olmo_eqx(*TINY, "data.sequence_length=2048", f"hydra.run.dir={run_dir}")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert output.startswith("error: ") and output.count("\n") == 1, output
    assert "data.sequence_length=2048" in output and "max_sequence_length=1024" in output
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "config.json").exists()
