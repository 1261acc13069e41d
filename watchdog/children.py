"""What a process the daemon starts (py-spy, a command receiver, ncclras) inherits from it.

The daemon's environment holds secrets (a receiver's `url_env` or `token_env`, the endpoint's
`basic_auth_password_env`): a child gets a PATH, a locale and a time zone, and nothing else.
"""

from __future__ import annotations

import os

KEPT = ("PATH", "LANG", "LC_ALL", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in KEPT}
    env.setdefault("PATH", DEFAULT_PATH)
    return env
