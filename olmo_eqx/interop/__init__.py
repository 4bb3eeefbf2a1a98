"""Other ecosystems' formats and tools: HF safetensors and config.json (`hf`), export of a
checkpoint as an HF model dir (`export`), KV-cached generation (`generate`), and the model that
EleutherAI's lm-evaluation-harness drives (`harness`, `python -m olmo_eqx.interop.harness`)."""
