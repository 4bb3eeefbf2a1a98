"""The one error a run stops with: bad input or a fault, said in one line.

Library code (the train loop, checkpoints, evaluation) raises subclasses of `RunError`; the
command line prints the message and exits with status 2 instead of a traceback. It lives
here, below every other module, so the library never imports the stage registry to raise.
"""

import errno
from typing import Optional

# OS errors of storage that is full or cannot be written: bad input (where the run was pointed),
# not a bug, so said in one line (`storage_refusal`).
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR}


class RunError(RuntimeError):
    """A run that cannot go on; the message names the input and the fix."""


class TrainError(RunError):
    """The run cannot start or go on (refused resume, locked run dir, bad token ids, a failed
    save, divergence); the message names the input and the fix."""


class EvalError(RunError, ValueError):
    """Input an evaluation cannot use (eval, compare, generate, the lm-eval harness). A RunError,
    so a stage lets it through to the command line's one-line message; a ValueError, which
    library callers of `olmo_eqx.evaluation` catch."""


def storage_refusal(error: BaseException) -> Optional[str]:
    """One line for a write refused by full or unwritable storage (the error or one it was
    raised from), naming the file and the fix; None for anything else."""
    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL | _UNWRITABLE and seen.filename:
            fix = ("free space there" if seen.errno in _FULL
                   else "make it writable, or choose another directory (hydra.run.dir=...)")
            return f"cannot write {seen.filename}: {seen.strerror}: {fix}, then rerun (a run resumes from its last checkpoint)"
        seen = seen.__cause__ or seen.__context__
    return None
