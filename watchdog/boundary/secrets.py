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
from collections.abc import Callable, Iterable

from watchdog.boundary import rank_files

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
    r"^license$|license[_-]?key|(^|[_-])pat$|plugin[_-]?config|^p$|^pw$|(?<!by)pass(in|out)?$|account[_-]?key|"
    r"authorization", re.IGNORECASE)
# Query parameters that carry a credential beyond those names: an Azure SAS signature (`sig=`)
_SECRET_QUERY_NAME = re.compile(r"^sig$|^code$", re.IGNORECASE)
# user:password@ in a URL (s3://, https://, redis://...) anywhere in a value, or before a host (user:pw@host) at
# the start of a value or of what an `=`, `,` or space joins to it (`--master-addr=user:pw@host`)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]{0,32}://)[^/@\s:]*:[^/@\s]*@")
_HOST_CREDENTIALS = re.compile(r"(?:^|(?<=[=,\s]))(?P<user>[\w.-]{1,256}):[^\s/@:]+@(?=[\w.-])")
# name=value at the start of a value, after ? or & in a URL, or after ; in a connection string (AccountKey=)
_QUERY = re.compile(r"(?P<lead>(?:^|[?&;])(?P<name>[^=&#;?\s]{1,64})=)(?P<value>[^&#;\s]*)")
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
# A header (`Name: value`): its value is a credential when its name looks secret (Authorization, Cookie,
# X-Api-Key, api-key, X-Vault-Token, X-Amz-Security-Token, Ocp-Apim-Subscription-Key...)
_HEADER = re.compile(r"^\s{0,8}(?P<name>[^\s:]{1,128})\s{0,8}:")
# A long option joined to its value: --name=value, --name:value
_JOINED = re.compile(r"(?P<name>--[^\s=:]{1,128})(?P<sep>[=:])(?P<value>.*)", re.DOTALL)
_OPENSSL_PASSWORDS = ("-pass", "-passin", "-passout")  # their value: pass:pw, env:VAR, file:path...


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
    found = _HEADER.match(value)
    return f"{found.group('name')}: {REDACTED}" if found and secret_name(found.group("name")) else redact_text(value)


def _user_password(value: str) -> str:
    """curl's and wget's `-u user:password`: the password hidden, and the whole value where the password is
    empty (an API key given as the user: `-u sk_live_...:`). `uid:gid` (docker --user 1000:1000) and a value
    without a password (`sudo -u alice`, where the tool asks for it) are kept."""
    user, sep, password = value.partition(":")
    if not sep or "://" in value or (user.isdigit() and password.isdigit()):
        return redact_text(value)
    return f"{redact_text(user)}:{REDACTED}" if password else REDACTED


def _hidden(value: str) -> str:
    return REDACTED


# Options whose value (the next argument, or joined: --user=, -ualice:pw, -HAuthorization:) has a rule of its own
_VALUE_RULES = {"-H": _header, "--header": _header, "-u": _user_password, "--user": _user_password,
                "-U": _user_password, "--proxy-user": _user_password}


def redact_arguments(argv: Iterable[str]) -> tuple[str, ...]:
    """A command line with its secrets hidden: the value of an option whose name looks secret, whether
    joined (`--hf-token=abc`, `--token:abc`, `-pabc`, `-Pabc`) or the next argument (`--hf-token abc`,
    `--gh-pat abc`, `-p pw`, openssl's `-passin pass:pw`); a credential header (`-H 'Authorization: ...'`,
    `-HAuthorization: ...`, `--header=Cookie: ...`); curl's `-u user:password`; `NAME=value` assignments; and
    whatever redact_text finds in any argument."""
    out: list[str] = []
    rule: Callable[[str], str] | None = None  # what the option before says of this argument
    for arg in argv:
        if rule is not None:
            out.append(rule(arg))
            rule = None
            continue
        kept, rule = _argument(arg)
        out.append(kept)
    return tuple(out)


def _argument(arg: str) -> tuple[str, Callable[[str], str] | None]:
    """One argument as it may be kept, and the rule for the argument after it (None: it stands alone)."""
    if arg in _VALUE_RULES:
        return arg, _VALUE_RULES[arg]
    if len(arg) > 2 and arg[:2] in _VALUE_RULES and arg[2] != "-":  # curl's glued -HAuthorization:..., -ualice:pw
        return arg[:2] + _VALUE_RULES[arg[:2]](arg[2:]), None
    if len(arg) > 3 and arg[:2] in ("-p", "-P") and arg[2] not in "-=" and not arg[2:].isdigit() and (
            arg not in _OPENSSL_PASSWORDS):
        return f"{arg[:2]}{REDACTED}", None  # -ppassword (MySQL), -Ppassword
    joined = _JOINED.match(arg)
    if joined and joined.group("name") in _VALUE_RULES:  # --header=Cookie: ..., --proxy-user=alice:pw
        name, value = joined.group("name"), joined.group("value")
        return name + joined.group("sep") + _VALUE_RULES[name](value), None
    arg = redact_text(arg)
    name, sep, _ = arg.partition("=")
    if not sep and arg.startswith("--") and ":" in arg:  # --token:abc
        name, sep, _ = arg.partition(":")
    if secret_name(name.lstrip("-")):
        if sep:
            return f"{name}{sep}{REDACTED}", None
        if arg.startswith("-"):
            return arg, _hidden
    return arg, None
