"""`python -m olmo_eqx.plan`: see olmo_eqx/plan/__init__.py."""

from olmo_eqx.plan.cli import main

if __name__ == "__main__":
    main()
