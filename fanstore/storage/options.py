"""Storage options: keyword arguments for a backend, given as JSON on the command line
(``--storage-options JSON``), in ``$FANSTORE_STORAGE_OPTIONS``, or in a file (``@FILE``).

Credentials never need the command line, where every user of the node can read them
(``ps``, ``/proc/PID/cmdline``): the environment and files are private to their owner.
:func:`exposure_warnings` gives the lines the CLI shows when a secret (``key``,
``secret``, ``token``, a password...) is given in argv anyway, or sits in a file others may
read.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fanstore.errors import UsageError

#: Storage options set by the command line (``--storage-options``); see default_options().
_default_options: dict[str, Any] | None = None

#: Largest options file read (the JSON of a few keyword arguments).
_MAX_OPTIONS_FILE = 1 << 20


def _read_options_file(path: str, where: str) -> str:
    if not path:
        raise UsageError(f"{where}: '@' must be followed by the name of a file holding the "
                         "JSON")
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(_MAX_OPTIONS_FILE + 1)
    except OSError as exc:
        raise UsageError(f"{where}: cannot read {path}: {exc.strerror}") from None
    if len(data) > _MAX_OPTIONS_FILE:
        raise UsageError(f"{where}: {path} is larger than {_MAX_OPTIONS_FILE >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{where}: {path} is not UTF-8 text") from None


def parse_storage_options(text: str | None, where: str = "--storage-options") -> dict[str, Any]:
    """Storage options as a dict: ``text`` is a JSON object, or ``@FILE`` naming a file
    that holds one (credentials stay out of the command line); a clear UsageError
    otherwise. ``where`` names the setting in messages."""
    if not text:
        return {}
    if text.startswith("@"):
        where = f"{where} {text}"
        text = _read_options_file(text[1:], where)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected a JSON object, e.g. "
                         '\'{"timeout": 10, "retries": 3}\'')
    return value


#: Option names (any level, any case) that hold credentials: s3fs's ``key``/``secret``/
#: ``token``, botocore's ``aws_secret_access_key``/``aws_session_token``, passwords...
_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "access_key",
                 "api_key", "apikey", "private_key")
_SECRET_NAMES = frozenset({"key", "pass", "authorization"})


def secret_names(options: Any) -> list[str]:
    """The names of options (nested ones as ``outer.inner``) that look like credentials."""
    found: list[str] = []

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                name = str(k)
                low = name.lower()
                if low in _SECRET_NAMES or any(w in low for w in _SECRET_WORDS):
                    if v not in (None, "", {}, []):
                        found.append(prefix + name)
                else:
                    walk(v, f"{prefix}{name}.")
        elif isinstance(value, list):
            for v in value:
                walk(v, prefix)

    walk(options, "")
    return found


def exposure_warnings(text: str | None, options: dict[str, Any],
                      on_command_line: bool = True) -> list[str]:
    """Lines for the user when the storage options given as ``text`` expose a secret:
    inline on the command line (readable by every user of the node), or in an ``@FILE``
    that other users may read. ``on_command_line``: False for the environment (private
    to its owner; only an ``@FILE`` there is checked)."""
    names = secret_names(options)
    if not text or not names:
        return []
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if not text.startswith("@"):
        if not on_command_line:
            return []
        return [(f"--storage-options on the command line holds credentials ({shown}), "
                 "which every user of this node can read (ps, /proc/PID/cmdline) while "
                 "FanStore runs; put them in the environment (AWS_ACCESS_KEY_ID, "
                 "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN), a credentials file "
                 "(AWS_SHARED_CREDENTIALS_FILE) or a file of your own (--storage-options "
                 "@FILE, mode 0600)")]
    path = os.path.expanduser(text[1:])
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return []
    if mode & 0o077:
        return [(f"{text[1:]} holds credentials ({shown}) but other users may read it "
                 f"(mode {mode & 0o7777:04o}); chmod 600 {text[1:]}")]
    return []


def set_default_options(options: dict[str, Any] | None) -> None:
    """Storage options for every location opened without explicit ones (the CLI sets them
    once; forked daemons inherit them, pack workers are sent them)."""
    global _default_options
    _default_options = dict(options) if options else None


def explicit_options() -> dict[str, Any] | None:
    """The options :func:`set_default_options` set (None: none), for a worker process to
    set in turn (it is a fresh interpreter: it inherits the environment, not these)."""
    return None if _default_options is None else dict(_default_options)


def default_options() -> dict[str, Any]:
    if _default_options is not None:
        return dict(_default_options)
    from fanstore.settings import current

    return parse_storage_options(current().storage_options, where="$FANSTORE_STORAGE_OPTIONS")

