"""A checkpoint of ours as a HF model directory (`+stage=export`, `olmo_eqx.export_hf`).

Takes what every stage takes (a run dir, its checkpoints dir, or one step dir; the latest
complete step unless a step dir is named) and writes `config.json` (EOS and pad ids from the
tokenizer), `generation_config.json`, the weights as safetensors and, when the run's tokenizer
is known (the embedded corpus's, `data.tokenizer`, or given), `tokenizer.json` with its
`tokenizer_config.json`: a directory `transformers` loads as Olmo3ForCausalLM (or Olmo2) with
AutoTokenizer, and `olmo_eqx.load_hf` loads back.
"""

import json
import os
from pathlib import Path
from typing import Literal, Optional

from olmo_eqx.config import Config


# Names that mark a directory as a run of ours (or its eval/generate output), never an export's.
_RUN_MARKS = ("checkpoints", "metrics.jsonl", "run.lock")
# What Hydra itself puts into a run dir before the stage runs (restored on a refusal by
# `olmo_eqx.__main__`): not the user's files.
_HYDRA_FILES = (".hydra", "olmo_eqx.log")


def check_export_dir(out: Path, *, overwrite: bool = False, key: str = "out_dir") -> None:
    """Refuse (a `StageError` naming `key`) to write an export into `out` when it holds anything
    but Hydra's own files (unless `overwrite`), or when it is a run's directory (whatever
    `overwrite` says): an export replaces config.json and removes weight shards there."""
    from olmo_eqx.stages import StageError

    out = Path(out)
    names = {p.name for p in out.iterdir()} - set(_HYDRA_FILES) if out.is_dir() else set()
    if out.exists() and not out.is_dir():
        raise StageError(f"{key}={out} is a file, not a directory: name a new directory for the export")
    config = out / "config.json"
    ours = "config.json" in names and config.is_file() and not _is_hf_config(config)
    if ours or any(mark in names for mark in _RUN_MARKS):
        raise StageError(f"{key}={out} is a training run's directory (its config.json, checkpoints): an export "
                         "would replace them; name a new directory")
    if names and not overwrite:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise StageError(f"{key}={out} is not empty ({shown}): name a new directory, or set stage.overwrite=true "
                         "to replace the files an export writes there")


def _is_hf_config(path: Path) -> bool:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def export_hf(path: str | os.PathLike, out_dir: str | os.PathLike, *,
              dtype: Optional[Literal["float32", "bfloat16"]] = None, tokenizer: Optional[str] = None,
              config: Optional[Config] = None, key: str = "checkpoint.load", overwrite: bool = False,
              out_key: str = "out_dir") -> dict:
    """Write the checkpoint `path` names as a HF directory `out_dir`; returns what was written.

    `dtype`: of the weights (default: the checkpoint's parameter dtype); `tokenizer`: the
    model's tokenizer.json when the run's own cannot be found; `config`: the run config used
    to find it otherwise (default: the defaults); `key`: the setting `path` came from, named
    in errors (a `StageError`); `overwrite`: write into a non-empty `out_dir` (never a
    run's directory; see `check_export_dir`); `out_key`: the setting `out_dir` came from.
    """
    from olmo_eqx.evaluation.run import find_tokenizer
    from olmo_eqx.evaluation.tokens import TextTokenizer
    from olmo_eqx.interop.hf import save_hf
    from olmo_eqx.sharding import ShardingRules, make_mesh
    from olmo_eqx.stages import StageError
    from olmo_eqx.warm_start import load_model, locate, stored_model_config

    config = config if config is not None else Config()
    out = Path(out_dir).expanduser().resolve()
    check_export_dir(out, overwrite=overwrite, key=out_key)
    location = locate(path, f"{key}={path}", allow_hf=False)
    model_config = stored_model_config(location)
    found = find_tokenizer(location, tokenizer, config, model_config.vocab_size)
    if found is not None and TextTokenizer(found).vocab_size > model_config.vocab_size:
        raise StageError(f"tokenizer {found} has more ids than the model's {model_config.vocab_size}: "
                         "it is not this model's tokenizer (set stage.tokenizer)")
    model = load_model(location, make_mesh(config.mesh), ShardingRules(), model_config=model_config)
    save_hf(model, out, dtype=dtype, tokenizer=found)
    hf = json.loads((out / "config.json").read_text())
    return {"source": str(location), "step": location.step, "out": str(out),
            "tokenizer": None if found is None else str(found),
            "eos_token_id": hf["eos_token_id"], "pad_token_id": hf["pad_token_id"],
            "dtype": hf["dtype"], "architecture": hf["architectures"][0]}
