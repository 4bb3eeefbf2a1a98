"""Leaving one machine: which cluster a process runs in, starting JAX's multi-controller runtime
there (`jax.distributed`), and launching the same command on every host of a TPU VM pod, GKE
(JobSet, XPK), SkyPilot, SLURM or Ray.

Every launcher ends in the same place: one `python -m olmo_eqx ...` per host, each finding its
peers from the environment its launcher gave it. Nothing here imports training code; the
launchers start the command as a process.
"""
