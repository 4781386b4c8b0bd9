"""API keys as a FastAPI dependency: `Authorization: Bearer <key>`, checked in constant time against every key.

    auth = require_api_key(ApiKeys.single(cfg.api_key))
    @app.get("/v1/models", dependencies=[auth])

Only SHA-256 digests of the keys are kept. A failed check is a 401 ApiError ("invalid_api_key").
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Depends, Request

from ragserve.http.errors import ApiError

MISSING = "missing API key: send 'Authorization: Bearer <key>'"
INVALID = "invalid API key"
SINGLE = "invalid or missing API key (send 'Authorization: Bearer KEY')"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass
class ApiKey:
    name: str
    digest: bytes  # SHA-256 of the key: the key itself is not kept around


@dataclass
class ApiKeys:
    keys: list[ApiKey] | None  # None: auth is off
    missing: str = MISSING  # the 401 messages
    invalid: str = INVALID

    @classmethod
    def single(cls, key: str | None) -> ApiKeys:
        """One shared key (or none: auth off); a missing and a wrong key get the same message."""
        return cls([ApiKey("api-key", digest(key))] if key else None, SINGLE, SINGLE)

    def check(self, authorization: str | None) -> ApiKey | None:
        """The matching key, None when auth is off; raises 401 otherwise. Compares against every key."""
        if self.keys is None:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, self.missing, "invalid_api_key")
        given = digest(token.strip())
        found = None
        for key in self.keys:
            if hmac.compare_digest(given, key.digest):
                found = key
        if found is None:
            raise ApiError(401, self.invalid, "invalid_api_key")
        return found


# admit(request, key): a further check once the key is known (e.g. a rate limit); raises ApiError to refuse
Admit = Callable[[Request, ApiKey | None], None]


def require_api_key(keys: ApiKeys, admit: Admit | None = None):
    """A FastAPI `Depends` that checks the key (then `admit`) before the handler runs; it yields the ApiKey."""

    async def api_key(request: Request) -> ApiKey | None:  # async: runs on the event loop, not a thread
        key = keys.check(request.headers.get("authorization"))
        if admit is not None:
            admit(request, key)
        return key

    return Depends(api_key)
