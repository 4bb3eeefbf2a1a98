"""`python -m olmo_eqx` for the suite, forked from a warm interpreter instead of started cold.

About sixty of the suite's commands come through `clihelp.olmo_eqx`, and each cold start paid
for importing JAX, Orbax, Hydra and the project (1.3 s of CPU) before its few seconds of work. Here a
server process (multiprocessing's forkserver, one per xdist worker) imports all of that once,
without starting a JAX backend, and forks a fresh child per command. The child is a process of
its own as before: its own environment, working directory, XLA devices (XLA_FLAGS is read when
the backend starts, in the child), exit status, stdout and stderr. It runs the package's
`__main__` the way `python -m olmo_eqx` does (`runpy`, so `exit_without_teardown` ends it), and
with the huge-page malloc setting the command would have re-executed itself with.

What a fork cannot change is what was read while the server started and imported: the
settings of Python's, glibc's, NumPy's and JAX's start-up (`READ_AT_START`) and the import path.
So a command whose environment differs from the server's in one of those (a PYTHONPATH with a
third-party stage, a JAX_* setting) is started cold, as is every command when
OLMO_EQX_TEST_FORK=0. The tests that are about the start itself (huge pages, signals, several
processes, sweeps' jobs) start their processes themselves and do not come here.
"""

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

# Settings read while a process starts or imports (Python, glibc, XLA's Python client, NumPy's
# BLAS, JAX, Equinox, jaxtyping, Hydra, the huge-page re-exec): a command whose environment
# differs from the server's in one of these is started cold. Anything else (XLA_FLAGS, read when
# the backend starts; the project's cache and store settings; PYTEST_CURRENT_TEST) is read after
# the fork, from the child's own environment.
READ_AT_START = (
    "PYTHON", "LD_", "GLIBC_", "MALLOC_", "TMPDIR", "JAX_", "XLA_PYTHON", "TF_", "TPU_", "LIBTPU", "NPY_",
    "OPENBLAS", "OMP_", "MKL_", "EQX_", "JAXTYPING", "HYDRA_", "OLMO_EQX_HUGE_PAGES",
)
READ_AT_RUN_TIME = ("HYDRA_FULL_ERROR",)  # read by the command's own main()

_server: Optional[multiprocessing.context.BaseContext] = None
_server_env: dict = {}


def _modules_every_command_imports() -> list[str]:
    """Imported by the server at its start: JAX, Equinox, Optax, Orbax and Hydra come with them."""
    from olmo_eqx.stages import stage_entry_points

    return ["olmo_eqx.__main__", *(point.module for point in stage_entry_points().values())]


def _nothing() -> None:
    pass


def _with_huge_pages(env: dict) -> dict:
    from olmo_eqx.run.huge_pages import environment_with_huge_pages

    return environment_with_huge_pages(env) or env


def _forkable(env: dict, server_env: dict) -> bool:
    """Whether a child forked from a server started with `server_env` is as if started with `env`."""
    differ = {k for k in set(env) | set(server_env) if env.get(k) != server_env.get(k)}
    return not any(k.startswith(READ_AT_START) and k not in READ_AT_RUN_TIME for k in differ)


def _start_server() -> dict:
    """Start the forkserver (once), with this process' environment as a command would get it;
    return that environment."""
    global _server, _server_env
    if _server is None:
        _server_env = _with_huge_pages(dict(os.environ))
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_modules_every_command_imports())
        saved = dict(os.environ)
        os.environ.update(_server_env)  # the server inherits os.environ when it starts
        try:
            probe = context.Process(target=_nothing)  # starts the server; its exit proves it works
            probe.start()
            probe.join()
            if probe.exitcode != 0:
                raise RuntimeError(f"the command server did not start (exit status {probe.exitcode})")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server = context
    return _server_env


def _child(args: list, env: dict, cwd: Optional[str], stdout: str, stderr: str, file_size_limit: int = 0) -> None:
    """In the forked child: become `python -m olmo_eqx ARGS` and run it to its exit."""
    if file_size_limit:  # a full disk: writes past the limit fail with EFBIG (SIGXFSZ ignored)
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    sys.path.insert(0, os.getcwd())  # `python -m` puts its working directory first
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["olmo_eqx", *args]
    # As in `python -m olmo_eqx`, where the package's __main__ is run, never imported, before.
    sys.modules.pop("olmo_eqx.__main__", None)
    runpy.run_module("olmo_eqx", run_name="__main__", alter_sys=True)


def run_command(
    args: list, env: dict, timeout: float, cwd: Optional[Path], cold: bool = False, file_size_limit: int = 0
) -> subprocess.CompletedProcess:
    """`python -m olmo_eqx ARGS` with exactly the environment `env`, like `subprocess.run` with
    `capture_output=True, text=True`: forked from the server where it can be, else (or when
    `cold`) started cold. With `file_size_limit`, no file the command writes may grow past that
    many bytes (RLIMIT_FSIZE, SIGXFSZ ignored: the writes fail with EFBIG, as on a full disk);
    its stdout and stderr stay pipes when started cold, files well under the limit when forked."""
    command = [sys.executable, "-m", "olmo_eqx", *args]
    child_env = _with_huge_pages(env)
    cold = cold or os.environ.get("OLMO_EQX_TEST_FORK") == "0"
    if cold or not _forkable(child_env, _start_server()):
        if file_size_limit:
            launcher = (
                "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size_limit}, {file_size_limit})); "
                "os.execv(sys.executable, [sys.executable, '-m', 'olmo_eqx', *sys.argv[1:]])"
            )
            command = [sys.executable, "-c", launcher, *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="olmo_eqx-command-") as scratch:
        out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
        out.touch()
        err.touch()
        child = _server.Process(
            target=_child,
            args=(args, child_env, None if cwd is None else str(cwd), str(out), str(err), file_size_limit),
        )
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(command, child.exitcode, out.read_text(), err.read_text())


class StartedCommand:
    """A `python -m olmo_eqx` running in the background (`start_command`)."""

    def __init__(self, process, stdout: Path, stderr: Path, scratch: tempfile.TemporaryDirectory):
        self.process, self._stdout, self._stderr, self._scratch = process, stdout, stderr, scratch

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its end (killed after `timeout` seconds, then TimeoutExpired), like `run_command`'s result."""
        self.process.join(timeout)
        try:
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
                raise subprocess.TimeoutExpired("olmo_eqx", timeout, self._stdout.read_text(), self._stderr.read_text())
            return subprocess.CompletedProcess("olmo_eqx", self.process.exitcode, self._stdout.read_text(),
                                               self._stderr.read_text())
        finally:
            self._scratch.cleanup()


class _ColdProcess:
    """A cold `python -m olmo_eqx` (subprocess.Popen) with the calls `StartedCommand` makes of a
    forked one (multiprocessing.Process): pid, join, exitcode, kill."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen
        self.pid = popen.pid

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> Optional[int]:
        return self.popen.poll()  # -N when killed by signal N, as multiprocessing says it

    def kill(self) -> None:
        self.popen.kill()


def start_command(args: list, env: dict, cwd: Optional[Path] = None) -> StartedCommand:
    """`run_command` without waiting, for a test that signals or kills the command while it runs
    (its `pid`), then `wait`s for it: forked from the server, or started cold when `env` cannot
    be forked (as `run_command` does)."""
    child_env = _with_huge_pages(env)
    scratch = tempfile.TemporaryDirectory(prefix="olmo_eqx-command-")
    out, err = Path(scratch.name) / "stdout", Path(scratch.name) / "stderr"
    out.touch()
    err.touch()
    if os.environ.get("OLMO_EQX_TEST_FORK") == "0" or not _forkable(child_env, _start_server()):
        with open(out, "w") as stdout, open(err, "w") as stderr:
            popen = subprocess.Popen([sys.executable, "-m", "olmo_eqx", *args], env=env, cwd=cwd, stdout=stdout,
                                     stderr=stderr, text=True)
        return StartedCommand(_ColdProcess(popen), out, err, scratch)
    child = _server.Process(target=_child, args=(args, child_env, None if cwd is None else str(cwd), str(out), str(err)))
    child.start()
    return StartedCommand(child, out, err, scratch)


def start_server(env: dict) -> bool:
    """Start the command server now (it imports for a second or more), so that a test timing its
    commands times the commands alone; False when `env` would be started cold anyway."""
    return _forkable(_with_huge_pages(env), _start_server())
