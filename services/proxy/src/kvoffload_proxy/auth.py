"""The proxy's API key (`--api-key` / `$KVOFFLOAD_API_KEY`): who must present what.

With a key set:

- clients send `Authorization: Bearer KEY` on every route except `GET /healthcheck` (load
  balancers; without the key it answers only the status, not the backends' addresses) and
  `GET /openapi.json` (public: it describes the routes and the bearer scheme, holds no secret);
  `/metrics` needs the key too (Prometheus: `authorization: {credentials: KEY}`);
- decoders never hold the key. `POST /v1/metaserver` needs `Authorization: Bearer TOKEN`, where
  TOKEN is a per-request capability the proxy hands the decoder in
  `kv_transfer_params.metaserver_token`: HMAC-SHA256 of the request id under a random secret the
  proxy draws at start-up and never shows. It authorizes the registration of that request id
  only; no one can compute it, a client holding the key included, so no one can register a
  decoder endpoint (where the prefill would push the prompt's KV) for a request they did not send
  through this proxy; and a decoder (or whoever reaches a decoder's HTTP port and names a
  metaserver URL of their own) never learns the client key.

Every comparison is constant-time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def matches(given: str | None, expected: str) -> bool:
    """Constant-time equality of a presented secret and the expected one (None never matches)."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class MetaserverTokens:
    """Issues and checks the per-request /v1/metaserver tokens (only when `enabled`: a key is set)."""

    def __init__(self, enabled: bool, secret: bytes | None = None):
        self.enabled = enabled
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def _token(self, request_id: str) -> str:
        return hmac.new(self._secret, request_id.encode(), hashlib.sha256).hexdigest()

    def issue(self, request_id: str) -> str | None:
        """The token a decoder of `request_id` presents, or None when no key is set."""
        return self._token(request_id) if self.enabled else None

    def check(self, given: str | None, request_id: str) -> bool:
        return not self.enabled or matches(given, self._token(request_id))
