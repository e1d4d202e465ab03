"""What a key below ``admin`` may not read: the secrets a slot's spec can carry.

A ``read`` key (a dashboard, Grafana) reads every slot's spec, its events and its files'
state; an ``admin`` key and the API token may change them, so they see them as written.
Below ``admin`` the API answers with the secrets withheld (as Kubernetes' ``view`` role
reads no Secret), by the rules of this module, pure:

- ``server.env``: every value (its names kept): an environment carries tokens
  (``HF_TOKEN``, an upstream's API key) under any name;
- arguments (``server.extra_args``, ``server.cmd``): the value of a flag whose name says
  it is one (``--api-key X``, ``--hf-token=X``: a word key, token, secret, password,
  auth, credential, cookie, signature; not ``--tokens-per-second``), the flag kept;
- every URL in any string (a model's ``source``, an endpoint flag): its user information
  (``user:password@``) and its query (a signed URL's signature) cut.

docs/reliability.md ("What each scope may read") says what each scope reads.
"""

from __future__ import annotations

import re
from typing import Any, Final

from controller.access.keys import Principal, Scope

__all__ = [
    "REDACTED",
    "sees_secrets",
    "withhold_argv",
    "withhold_slot",
    "withhold_spec",
    "withhold_strings",
    "withhold_text",
]

REDACTED: Final = "<redacted>"
# A flag's words (split at - and _) that say its value is a secret: ``--api-key``,
# ``--hf-token``, ``--password``; never ``--tokens-per-second`` or ``--max-num-batched-tokens``.
_SECRET_WORDS: Final = frozenset(
    {"key", "token", "secret", "password", "passwd", "auth", "authorization", "credential"}
    | {"credentials", "cookie", "signature", "sig", "bearer"}
)
_SECRET_SUFFIXES: Final = ("token", "apikey", "secret", "password")
_URL: Final = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^/@\s'\"]*@)?(?P<rest>[^\s?#'\"]*)"
    r"(?P<query>[?#][^\s'\"]*)?",
    re.IGNORECASE,
)


def sees_secrets(principal: Principal | None) -> bool:
    """Whether ``principal`` reads secrets as written: ``admin`` (the API token too);
    None (no principal) does not."""
    return principal is not None and principal.scope >= Scope.ADMIN


def _url(match: re.Match[str]) -> str:
    user = f"{REDACTED}@" if match.group("user") else ""
    query = "?" + REDACTED if match.group("query") else ""
    return match.group("scheme") + user + match.group("rest") + query


def withhold_text(text: str) -> str:
    """``text`` with every URL's user information and query withheld."""
    return _URL.sub(_url, text) if "://" in text else text


def _secret_flag(arg: str) -> bool:
    if not arg.startswith("-"):
        return False
    words = re.split(r"[-_.]", arg.lstrip("-").lower())
    return any(w in _SECRET_WORDS or w.endswith(_SECRET_SUFFIXES) for w in words if w)


def withhold_argv(args: list[str]) -> list[str]:
    """Arguments with the value of each secret flag withheld (``--api-key X`` and
    ``--api-key=X``), and every URL's credentials."""
    out: list[str] = []
    after_flag = False
    for arg in args:
        if after_flag and not arg.startswith("-"):
            out.append(REDACTED)
            after_flag = False
            continue
        after_flag = False
        name, eq, _ = arg.partition("=")
        if _secret_flag(name):
            if eq:
                out.append(f"{name}={REDACTED}")
                continue
            after_flag = True
        out.append(withhold_text(arg))
    return out


def withhold_strings(value: Any) -> Any:
    """Every string in ``value`` (JSON: dicts, lists) with its URLs' credentials cut."""
    if isinstance(value, str):
        return withhold_text(value)
    if isinstance(value, list):
        return [withhold_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: withhold_strings(v) for k, v in value.items()}
    return value


def withhold_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A slot's (or a model's) spec as JSON, its secrets withheld (a new dict)."""
    out: dict[str, Any] = withhold_strings(spec)
    server = out.get("server")
    if isinstance(server, dict):
        env = server.get("env")
        if isinstance(env, dict):
            server["env"] = dict.fromkeys(env, REDACTED)
        for key in ("extra_args", "cmd"):
            args = spec.get("server", {}).get(key)
            if isinstance(args, list) and all(isinstance(a, str) for a in args):
                server[key] = withhold_argv(args)
    return out


def withhold_slot(data: dict[str, Any]) -> dict[str, Any]:
    """A slot as the API shows it (its view, and its ``spec`` when there is one), its
    secrets withheld (a new dict)."""
    spec = data.get("spec")
    out = withhold_strings({k: v for k, v in data.items() if k != "spec"})
    if isinstance(spec, dict):
        out["spec"] = withhold_spec(spec)
    elif "spec" in data:
        out["spec"] = spec
    return dict(out)
