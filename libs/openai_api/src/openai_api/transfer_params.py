"""``KVTransferParams``: the typed ``kv_transfer_params`` of a request body, the P/D wiring; the
proxy builds it, the decode, the prefill and the vLLM connectors read it. Field names are the
wire's (vLLM's P/D connectors spell them so). Two hops carry it:

- proxy -> decode: ``do_remote_prefill`` (the prompt's KV comes from a prefill),
  ``do_remote_decode``, ``metaserver`` (the URL the decode registers at), ``request_id`` (the
  child id both sides use), ``metaserver_token`` (the decode's bearer token for that registration,
  when the proxy has an API key);
- decode -> the proxy's ``/v1/metaserver`` -> prefill: ``request_id``, ``remote_host``,
  ``remote_port`` (decode TP rank t listens on ``remote_port + t``), ``remote_tp_size``,
  ``remote_dp_rank``; or ``{request_id, queued: true}`` (admitted, still waiting for host blocks).

Types are strict: a wrong one is refused with a message naming the field. Fields the model does not
name are kept and relayed verbatim (``wire()``): other decoders register fields of their own
(``engine_id``, ``remote_dp_size``, ...) that the proxy hands on to their prefill.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from openai_api.body import RequestError, validated

MAX_PORT = 65535


class KVTransferParams(BaseModel):
    """One request's ``kv_transfer_params`` (module doc); unset fields take the defaults below."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    metaserver: str | None = None
    request_id: str | None = None
    metaserver_token: str | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(default=None, ge=1, le=MAX_PORT)
    remote_tp_size: int = Field(default=1, ge=1)
    remote_dp_rank: int | None = Field(default=None, ge=0)
    queued: bool = False

    def wire(self) -> dict[str, Any]:
        """The JSON object as it was given or built: the fields set, unknown ones included."""
        return self.model_dump(exclude_unset=True)

    @property
    def names_decode(self) -> bool:
        """The params name a decode endpoint (the prefill side's form)."""
        return self.remote_host is not None or self.remote_port is not None

    def decode_endpoints(self) -> list[str]:
        """The control endpoints ("host:port") of the decode's TP ranks: rank t of
        ``remote_tp_size`` listens on ``remote_port + t``."""
        host, port, tp = self.remote_host, self.remote_port, self.remote_tp_size
        if not host or port is None or port + tp - 1 > MAX_PORT:
            raise RequestError(
                "kv_transfer_params: remote_host (str), remote_port (1..65535) and remote_tp_size "
                f"(int >= 1, its ports at most 65535) are required, got {self.wire()!r}"
            )
        return [f"{host}:{port + t}" for t in range(tp)]

    @property
    def registration_token(self) -> str | None:
        """``metaserver_token`` when it is a short token of visible ASCII, else None: anything else is
        ignored, never sent in a header (see the proxy's auth.py)."""
        token = self.metaserver_token
        if token is not None and 0 < len(token) <= 256 and all("!" <= c <= "~" for c in token):
            return token
        return None


def parse_transfer_params(value: Any, where: str = "kv_transfer_params") -> KVTransferParams | None:
    """``value`` (the body's ``kv_transfer_params``, or one entry of a list of them, named ``where``)
    as ``KVTransferParams``; None when absent, null or empty. RequestError naming the field."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"{where}: must be an object, got {type(value).__name__}")
    return validated(KVTransferParams, value, where=where)


def parse_transfer_params_list(value: Any, count: int) -> list[KVTransferParams | None]:
    """The body's ``kv_transfer_params_list``: one entry per child (``count``), each checked."""
    if not isinstance(value, list) or len(value) != count:
        raise RequestError(f"kv_transfer_params_list: must give one entry per prompt and choice ({count})")
    return [parse_transfer_params(v, f"kv_transfer_params_list[{i}]") for i, v in enumerate(value)]
