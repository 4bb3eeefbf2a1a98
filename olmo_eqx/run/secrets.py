"""Secrets: what the environment gives a run is used, never recorded or printed in the clear.

A setting written `${oc.env:NAME}` (or with the value inside a longer string) is recorded in
config.json and every checkpoint's config as that interpolation, not its value
(`with_interpolations`, which `olmo_eqx.config.config_to_dict` applies), and the value is
replaced by `***` in every line a run prints or logs and every file its `RunDir` writes
(`hide_secrets`). A URL with a user name or password in it (`http://user:pass@host/...`) is
refused, by the config check and by the remote reader, with the credentials hidden: it would
otherwise be printed in errors and recorded with the config.
"""

import os
import re
from typing import Any

# `scheme://user[:password]@`: a user info part ends at the first `@` before the path (a `/` or
# `@` inside a password must be percent-encoded).
_USER_INFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def hide_credentials(text: str) -> str:
    """`text` with the user name and password of every URL in it replaced by `***`."""
    return _USER_INFO.sub(r"\1***@", text)


def has_credentials(url: str) -> bool:
    """True for a URL that carries a user name or password (`http://user:pass@host/...`)."""
    return bool(_USER_INFO.match(url.strip()))


def credentials_refusal(url: str, what: str, sep: str = " ") -> str:
    """The line that refuses a URL with credentials in it, without repeating them: such a URL
    would be printed in errors and progress lines and recorded in config.json and every
    checkpoint in the clear, so it is refused, not read."""
    return (f"{what}{sep}{hide_credentials(url)}: the URL carries a user name or password, which would be printed and "
            "recorded in the clear; remove it from the URL and give credentials to the store instead (S3: "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or ~/.aws; GCS: Application Default Credentials; HTTP: a "
            "presigned URL)")


# ---------------------------------------------------------------------------------------------
# Secrets: what the environment gave a run is used, never recorded or printed in the clear.

# Where the last `to_config` found `${oc.env:...}`: key path -> (the interpolation as written,
# its resolved value). Module state, as a run is one process (a sweep runs each job in its own).
_FROM_ENVIRONMENT: dict[tuple, tuple[str, Any]] = {}
# The values of the environment variables those interpolations read: hidden in every message.
_SECRET_VALUES: set[str] = set()
_ENV_INTERPOLATION = re.compile(r"\$\{(?:oc\.env|env):\s*([A-Za-z_][A-Za-z0-9_]*)")
# Shorter values (a "1", a "true") would hide ordinary words and numbers, and reveal little.
_SHORTEST_SECRET = 4


def leaves(values: Any, path: tuple = ()):
    """(key path, value) of every leaf of nested dicts, lists and tuples."""
    if isinstance(values, dict):
        for key, value in values.items():
            yield from leaves(value, (*path, key))
    elif isinstance(values, (list, tuple)):
        for i, value in enumerate(values):
            yield from leaves(value, (*path, i))
    else:
        yield path, values


def _at(values: Any, path: tuple) -> Any:
    for key in path:
        values = values[key]
    return values


def remember_environment(raw: Any, resolved: Any) -> None:
    """Note which settings of a config come from the environment: `raw` is the config as
    written (interpolations unresolved), `resolved` the same with their values."""
    _FROM_ENVIRONMENT.clear()
    for path, text in leaves(raw, ()):
        if not isinstance(text, str) or not (names := _ENV_INTERPOLATION.findall(text)):
            continue
        try:
            _FROM_ENVIRONMENT[path] = (text, _at(resolved, path))
        except (KeyError, IndexError, TypeError):
            continue
        _SECRET_VALUES.update(v for n in names if len(v := os.environ.get(n, "")) >= _SHORTEST_SECRET)


def hide_secrets(text: str) -> str:
    """`text` with every value a config read from the environment, and every URL's user name
    and password, replaced by `***`: for error lines and logs."""
    for value in sorted(_SECRET_VALUES, key=len, reverse=True):
        text = text.replace(value, "***")
    return hide_credentials(text)


def with_interpolations(values: Any, path: tuple = ()) -> Any:
    """A config's plain data with each setting read from the environment as its interpolation
    (another string holding a secret value: that value hidden)."""
    if (path in _FROM_ENVIRONMENT and _FROM_ENVIRONMENT[path][1] == values) or (
            isinstance(values, str) and any(v in values for v in _SECRET_VALUES)):
        return _FROM_ENVIRONMENT[path][0] if path in _FROM_ENVIRONMENT else hide_secrets(values)
    if isinstance(values, dict):
        return {k: with_interpolations(v, (*path, k)) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return type(values)(with_interpolations(v, (*path, i)) for i, v in enumerate(values))
    return values


