"""Kept for `python -m olmo_eqx.harness` and `import olmo_eqx.harness` (the path before 0.1's
layout change): the lm-evaluation-harness model is `olmo_eqx.interop.harness`."""

from olmo_eqx.interop.harness import *  # noqa: F401,F403
from olmo_eqx.interop.harness import main

if __name__ == "__main__":
    main()
