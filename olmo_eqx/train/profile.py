"""`trainer.profile_steps=[start, stop]`: a jax.profiler trace of those steps in `<run dir>/profile`.

The trace covers dispatch and execution of steps start..stop: it starts before step `start`
is dispatched and stops once step `stop`'s results are ready (so asynchronous execution on an
accelerator is inside it). It writes `profile/plugins/profile/<timestamp>/<host>.xplane.pb`,
which TensorBoard's profile plugin (`pip install tensorboard-plugin-profile`, then
`tensorboard --logdir <run dir>/profile`) or XProf opens; `perfetto_trace.json.gz` next to it
opens in https://ui.perfetto.dev. Process 0 only.
"""

from pathlib import Path
from collections.abc import Callable
from typing import Any, Optional

import jax

PROFILE_DIR = "profile"


class StepProfiler:
    """Start and stop one trace around a range of steps; a no-op without a range."""

    def __init__(self, steps: Optional[tuple[int, int]], run_dir: Path, enabled: bool, say: Callable[[str], None]):
        self.steps = steps if enabled else None
        self.directory = Path(run_dir) / PROFILE_DIR
        self.say = say
        self.active = False

    def before_step(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0] and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.active = True

    def after_step(self, step: int, outputs: Any) -> None:
        if self.active and step >= self.steps[1]:
            self.stop(outputs)

    def stop(self, outputs: Any = None) -> None:
        """End the trace (also when the run stops inside the range); waits for `outputs` first."""
        if not self.active:
            return
        if outputs is not None:
            jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.active = False
        self.say(f"profile of steps {self.steps[0]}-{self.steps[1]} written to {self.directory} "
                 "(open: tensorboard --logdir with tensorboard-plugin-profile, or the perfetto_trace.json.gz in ui.perfetto.dev)")
