"""`python -m olmo_eqx +stage=export checkpoint.load=<run dir | checkpoints dir | step dir>`.

Writes the checkpoint as a HF model directory (`olmo_eqx.interop.export.export_hf`): the run dir
itself, `<run>.export/` next to a run of ours unless hydra.run.dir says otherwise. It loads with
`transformers.AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer`, and with
`olmo_eqx.load_hf(dir)`.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from olmo_eqx.config import Config


@dataclass(frozen=True)
class ExportSettings:
    """How `+stage=export` writes the HF directory."""

    # Weights' dtype; null: the checkpoint's parameter dtype.
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    # The model's tokenizer.json; null: the run's (the embedded corpus's, or data.tokenizer).
    tokenizer: Optional[str] = None
    # Write into a directory that already holds files (a previous export's are replaced); a
    # training run's directory is refused whatever this says.
    overwrite: bool = False


class Export:
    """Write a checkpoint of ours as a HF model directory (config, generation config, tokenizer, safetensors)."""

    description = "Write checkpoint.load (a run, checkpoints or step dir) as a HF model dir loadable by transformers"
    config_class = ExportSettings

    def run(self, config: Config, run_dir: Path) -> Optional[dict]:
        import jax

        from olmo_eqx.config import stage_settings
        from olmo_eqx.interop.export import export_hf
        from olmo_eqx.run.run_dir import RunDir
        from olmo_eqx.stages import StageError

        settings = stage_settings(self, "export", config.stage or {})
        if not config.checkpoint.load:
            raise StageError("export needs a checkpoint: checkpoint.load=<run dir | checkpoints dir | step dir>")
        run_dir = Path(run_dir).resolve()
        result = export_hf(config.checkpoint.load, run_dir, dtype=settings.dtype, tokenizer=settings.tokenizer,
                           config=config, overwrite=settings.overwrite,
                           out_key="hydra.run.dir")
        with RunDir(run_dir, enabled=jax.process_index() == 0, log_name="export.log") as out:
            tokenizer = result["tokenizer"] or "unknown (no tokenizer.json written; set stage.tokenizer)"
            out.print(f"export: {result['source']} -> {run_dir} ({result['architecture']}, {result['dtype']}) | "
                      f"tokenizer {tokenizer} | eos {result['eos_token_id']}, pad {result['pad_token_id']}")
            out.write_summary(result)
        return result
