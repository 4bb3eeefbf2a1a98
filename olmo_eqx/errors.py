"""The one error a run stops with: bad input or a fault, said in one line.

Library code (the train loop, checkpoints, evaluation) raises subclasses of `RunError`; the
command line prints the message and exits with status 2 instead of a traceback. It lives
here, below every other module, so the library never imports the stage registry to raise.
"""


class RunError(RuntimeError):
    """A run that cannot go on; the message names the input and the fix."""


class EvalError(RunError, ValueError):
    """Input an evaluation cannot use (eval, compare, generate, the lm-eval harness). A RunError,
    so a stage lets it through to the command line's one-line message; a ValueError, which
    library callers of `olmo_eqx.evaluation` catch."""
