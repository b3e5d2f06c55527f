"""What object stores' errors say to a user: the cause in plain words (credentials, a missing
bucket), and never a credential (``storage_options`` secrets and the AWS variables' values are
scrubbed from every message and log line)."""

from __future__ import annotations

import os
from typing import Any

_SECRET_WORDS = ("key", "secret", "token", "password", "credential")
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


def scrub(text: str, storage_options: dict[str, Any]) -> str:
    """``text`` with every credential it could carry replaced: messages and logs never show
    ``storage_options`` secrets or the AWS variables' values."""
    secrets = [
        v
        for k, v in _flatten(storage_options)
        if isinstance(v, str) and len(v) >= 4 and any(w in k.lower() for w in _SECRET_WORDS)
    ]
    secrets += [os.environ[k] for k in _SECRET_ENV if len(os.environ.get(k, "")) >= 4]
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _flatten(options: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(options, dict):
        return [(prefix, options)]
    out = []
    for k, v in options.items():
        out += _flatten(v, f"{prefix}.{k}")
    return out


def explain(url: str, e: Exception) -> str:
    """What an object store's error means for ``url``, in words a user can act on."""
    text = str(e) or type(e).__name__
    lowered = text.lower()
    rejected = (
        "invalidaccesskeyid",
        "signaturedoesnotmatch",
        "access denied",
        "accessdenied",
        "forbidden",
        "credentials",
    )
    if any(s in lowered for s in rejected):
        return (
            f"{url}: the credentials were rejected ({text}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or [checkpoint] storage_options"
        )
    if "bucket" in lowered and ("not exist" in lowered or "nosuchbucket" in lowered):
        return f"{url}: the bucket does not exist ({text}); create it or fix the URL"
    return f"{url}: {type(e).__name__}: {text}"
