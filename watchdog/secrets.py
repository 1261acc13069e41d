"""The one reader of secrets: a password, token or URL that comes from a file or an environment variable.

Every component that needs a secret (the endpoint's basic auth, the dump token, the alert receivers, the
coordinator's node token and its callers' token) reads it here, so the rules hold everywhere at once: the
file is read bounded (a secret is small; a FIFO or a device named by mistake is refused, never waited on),
surrounding whitespace is stripped, an empty secret is an error, and no message ever holds the value.
"""

from __future__ import annotations

import os

from watchdog import rank_files

MAX_SECRET_BYTES = 64 * 1024


class SecretError(ValueError):
    """A secret that cannot be read: the message names where it should come from, never its value."""


def read_file(path: str, what: str) -> str:
    """The stripped text of a secret file. `what` names it in errors (e.g. "dump.token_file")."""
    try:
        data = rank_files.read_given(path, MAX_SECRET_BYTES, timeout_seconds=5.0)
    except rank_files.RankFileError as exc:
        raise SecretError(f"{what}: {exc}") from None
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SecretError(f"{what}: {path} is not UTF-8 text") from None
    if not text:
        raise SecretError(f"{what}: {path} is empty")
    return text


def read_env(name: str, what: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise SecretError(f"{what}: environment variable {name} is not set")
    if not value.strip():
        raise SecretError(f"{what}: environment variable {name} is empty")
    return value.strip()


def read(file: str | None, env: str | None, what: str) -> str | None:
    """The secret from `file` or else the variable `env`; None when neither is given."""
    if file:
        return read_file(file, f"{what}_file")
    if env:
        return read_env(env, f"{what}_env")
    return None


def one_line_token(token: str, what: str) -> str:
    """A bearer token goes into a header: one line of printable ASCII, or an error naming `what`."""
    if any(not (0x21 <= ord(c) <= 0x7E) for c in token):
        raise SecretError(f"{what}: the token must be one line of printable ASCII")
    return token
