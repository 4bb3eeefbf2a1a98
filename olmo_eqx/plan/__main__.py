"""`python -m olmo_eqx.plan`: see olmo_eqx/plan/__init__.py."""

import sys

from olmo_eqx.plan.cli import main

if __name__ == "__main__":
    try:
        main()
    except SystemExit as refused:
        # The planner refuses bad input by raising SystemExit with its one line; Python would
        # exit 1 for it, where every olmo_eqx command exits 2 for bad input.
        if not isinstance(refused.code, str):
            raise
        print(refused.code, file=sys.stderr)
        raise SystemExit(2) from None
