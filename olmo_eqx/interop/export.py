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


def export_hf(path: str | os.PathLike, out_dir: str | os.PathLike, *,
              dtype: Optional[Literal["float32", "bfloat16"]] = None, tokenizer: Optional[str] = None,
              config: Optional[Config] = None, key: str = "checkpoint.load") -> dict:
    """Write the checkpoint `path` names as a HF directory `out_dir`; returns what was written.

    `dtype`: of the weights (default: the checkpoint's parameter dtype); `tokenizer`: the
    model's tokenizer.json when the run's own cannot be found; `config`: the run config used
    to find it otherwise (default: the defaults); `key`: the setting `path` came from, named
    in errors (a `StageError`).
    """
    from olmo_eqx.evaluation.run import find_tokenizer
    from olmo_eqx.evaluation.tokens import TextTokenizer
    from olmo_eqx.interop.hf import save_hf
    from olmo_eqx.sharding import ShardingRules, make_mesh
    from olmo_eqx.stages import StageError
    from olmo_eqx.warm_start import load_model, locate, stored_model_config

    config = config if config is not None else Config()
    location = locate(path, f"{key}={path}", allow_hf=False)
    model_config = stored_model_config(location)
    found = find_tokenizer(location, tokenizer, config, model_config.vocab_size)
    if found is not None and TextTokenizer(found).vocab_size > model_config.vocab_size:
        raise StageError(f"tokenizer {found} has more ids than the model's {model_config.vocab_size}: "
                         "it is not this model's tokenizer (set stage.tokenizer)")
    model = load_model(location, make_mesh(config.mesh), ShardingRules(), model_config=model_config)
    out = Path(out_dir).expanduser().resolve()
    save_hf(model, out, dtype=dtype, tokenizer=found)
    hf = json.loads((out / "config.json").read_text())
    return {"source": str(location), "step": location.step, "out": str(out),
            "tokenizer": None if found is None else str(found),
            "eos_token_id": hf["eos_token_id"], "pad_token_id": hf["pad_token_id"],
            "dtype": hf["dtype"], "architecture": hf["architectures"][0]}
