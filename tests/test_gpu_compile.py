"""The GPU path, compiled (never run) by XLA:GPU on this CPU machine, when JAX's CUDA plugin is
installed (`pip install -c constraints.txt -e '.[gpu]'`, about 4.4 GB of CUDA wheels: not in
the test extras, so CI skips this file and says so). docs/planning.md says how it works.
"""

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (the gpu extra)")

from olmo_eqx.config import compose_config  # noqa: E402
from olmo_eqx.plan import plan_config  # noqa: E402
from olmo_eqx.plan.targets import gpu_devices, parse_target  # noqa: E402


def test_train_step_compiles_for_h100s_with_cudnn_attention_and_a_roofline():
    target = parse_target("gpu:h100:8")
    config = compose_config(["model=olmo3_tiny", "model.compute_dtype=bfloat16", "data.sequence_length=256",
                             "data.global_batch_size=16"])
    p = plan_config(config, target, gpu_devices(target), estimate=True)
    assert p["attention_kernel"] == "cudnn" and p["fits"] and p["devices"] == 8
    assert 0 < p["bytes"]["temporaries"] < p["hbm_per_device"]
    est = p["estimate"]
    # No time model on GPU: the roofline only, from XLA's FLOPs (loops reconciled) + cuDNN's.
    assert est["xla_seconds"] is None and est["roofline_seconds"] > 0
    assert 0.9 < est["reconciled_over_model_flops"] < 1.5
