"""The one reader of secrets (a password, token or URL from a file or an environment variable), and the one
redactor of the secrets a rank holds (its command line and environment).

Every component that needs a secret (the endpoint's basic auth, the dump token, the alert receivers, the
coordinator's node token and its callers' token) reads it here, so the rules hold everywhere at once: the
file is read bounded (a secret is small; a FIFO or a device named by mistake is refused, never waited on),
surrounding whitespace is stripped, an empty secret is an error, and no message ever holds the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

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


# -- what a rank holds: its command line and environment are kept for diagnosis, its secrets never ----------
REDACTED = "<redacted>"

# Names that look like they hold a secret: their values never reach a bundle, a log line or a metric.
_SECRET_NAME = re.compile(
    r"token(?!iz)|secret|passw|passphrase|pwd|credential|api[_-]?key|access[_-]?key|private[_-]?key|[_-]key$|"
    r"^key$|^auth$|auth[_-]?(token|key|header)|bearer|jwt|signature|cookie|hmac|^session$|session[_-]?(id|key)|"
    r"^license$|license[_-]?key|(^|[_-])pat$|plugin[_-]?config|^p$|^pw$", re.IGNORECASE)
# Query parameters that carry a credential beyond those names: an Azure SAS signature (`sig=`)
_SECRET_QUERY_NAME = re.compile(r"^sig$|^code$", re.IGNORECASE)
# user:password@ in a URL (s3://, https://, redis://...) or before a host (user:pw@host), anywhere in a value
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]{0,32}://)[^/@\s:]*:[^/@\s]*@")
_HOST_CREDENTIALS = re.compile(r"^(?P<user>[\w.-]{1,256}):[^\s/@:]+@(?=[\w.-])")
# ?name=value or &name=value in a URL
_QUERY = re.compile(r"(?P<lead>[?&;](?P<name>[^=&#;\s]{1,64})=)(?P<value>[^&#;\s]*)")
# Webhook URLs whose path is the credential (Slack, Discord, Microsoft Teams)
_WEBHOOK_PATH = re.compile(r"(?P<host>(?:hooks\.slack\.com/(?:services|workflows|triggers)|"
                           r"discord(?:app)?\.com/api/webhooks|\.webhook\.office\.com/webhookb2)/)[^\s?#\"']+",
                           re.IGNORECASE)
# Tokens recognisable by their own shape, wherever they stand: GitHub, GitLab, Hugging Face, Slack, OpenAI-style,
# AWS access key ids, JWTs
_TOKEN_SHAPE = re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,255}|github_pat_[A-Za-z0-9_]{20,255}|"
                          r"glpat-[A-Za-z0-9_-]{20,255}|hf_[A-Za-z0-9]{20,255}|xox[abposr]-[A-Za-z0-9-]{10,255}|"
                          r"sk-[A-Za-z0-9_-]{20,255}|AKIA[0-9A-Z]{16}|eyJ[A-Za-z0-9_-]{8,4096}\.[A-Za-z0-9_-]{8,4096}"
                          r"\.[A-Za-z0-9_-]{0,4096})")
# A header argument (-H/--header) whose value carries a credential
_HEADER_OPTIONS = ("-H", "--header")
_SECRET_HEADER = re.compile(r"^\s{0,8}(authorization|proxy-authorization|cookie|x-api-key|x-auth-token|"
                            r"private-token|x-goog-api-key)\s{0,8}:", re.IGNORECASE)


def secret_name(name: str) -> bool:
    """Whether a variable, option or query parameter named `name` holds a secret by its name."""
    return bool(_SECRET_NAME.search(name))


def redact_text(value: str) -> str:
    """A value with the secrets inside it hidden: `user:password@` of a URL or before a host, a URL's
    secret-named query parameters (`token=`, `X-Amz-Signature=`, SAS `sig=`), a webhook URL's path, and
    tokens known by their shape (`ghp_...`, `hf_...`, `xoxb-...`, a JWT)."""
    value = _URL_CREDENTIALS.sub(rf"\g<scheme>{REDACTED}@", value)
    value = _HOST_CREDENTIALS.sub(rf"\g<user>:{REDACTED}@", value)
    if "=" in value:
        value = _QUERY.sub(_query_value, value)
    value = _WEBHOOK_PATH.sub(rf"\g<host>{REDACTED}", value)
    return _TOKEN_SHAPE.sub(REDACTED, value)


def _query_value(found: re.Match[str]) -> str:
    name = found.group("name")
    if secret_name(name) or _SECRET_QUERY_NAME.search(name):
        return found.group("lead") + REDACTED
    return found.group(0)


def redact_variable(name: str, value: str) -> str:
    """An environment variable's value as it may be kept: hidden whole when its name looks secret
    (`HF_TOKEN`, `NCCL_NET_PLUGIN_CONFIG`), else with the secrets inside it hidden (`MASTER_ADDR=user:pw@host`)."""
    return REDACTED if secret_name(name) else redact_text(value)


def _header(value: str) -> str:
    found = _SECRET_HEADER.match(value)
    return f"{found.group(1)}: {REDACTED}" if found else redact_text(value)


def redact_arguments(argv: Iterable[str]) -> tuple[str, ...]:
    """A command line with its secrets hidden: the value of an option whose name looks secret, whether
    joined (`--hf-token=abc`, `--token:abc`, `-pabc`, `-Pabc`) or the next argument (`--hf-token abc`,
    `--gh-pat abc`, `-p pw`); a credential header (`-H 'Authorization: ...'`, `-HAuthorization: ...`,
    `--header=Cookie: ...`); `NAME=value` assignments; and whatever redact_text finds in any argument."""
    out: list[str] = []
    hide_next = header_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if header_next:
            header_next = False
            out.append(_header(arg))
            continue
        if arg in _HEADER_OPTIONS:
            header_next = True
            out.append(arg)
            continue
        if arg.startswith("--header=") or arg.startswith("--header:"):
            out.append(arg[:9] + _header(arg[9:]))
            continue
        if len(arg) > 2 and arg.startswith("-H") and arg[2] != "-":  # -HAuthorization: ... (curl's glued form)
            out.append("-H" + _header(arg[2:]))
            continue
        if len(arg) > 3 and arg[:2] in ("-p", "-P") and arg[2] not in "-=" and not arg[2:].isdigit():
            out.append(f"{arg[:2]}{REDACTED}")  # -ppassword (MySQL), -Ppassword
            continue
        arg = redact_text(arg)
        name, sep, _ = arg.partition("=")
        if not sep and arg.startswith("--") and ":" in arg:  # --token:abc
            name, sep, _ = arg.partition(":")
        if secret_name(name.lstrip("-")):
            if sep:
                out.append(f"{name}{sep}{REDACTED}")
                continue
            hide_next = arg.startswith("-")
        out.append(arg)
    return tuple(out)
