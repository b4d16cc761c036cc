"""kvoffload-proxy: the OpenAI-compatible front door of the layerwise P/D deployment.

Decode first: a request goes to the least-loaded decoder with `kv_transfer_params.metaserver`
pointing back here; the decoder registers its endpoint at /v1/metaserver; the proxy then sends the
prompt to the least-loaded prefiller (max_tokens=1, the decoder's params) and answers the decoder
once that prefill completed; decoder tokens are relayed to the client.

- ``config``: flags -> ``ProxyConfig``, validated once at the edge.
- ``schemas``: what the proxy reads of a request (``openai_api`` validates the body) and the
  ``/v1/metaserver`` registration.
- ``auth``: the API key (``--api-key``) and the metaserver tokens of decoders.
- ``balancer``: least-loaded backend choice with load accounting (one per role).
- ``metaserver``: the registration rendezvous behind ``POST /v1/metaserver``.
- ``upstream``: backend calls with bounded retries, every failure mapped to a ``ProxyError``.
- ``flow``: one client request end to end, decode first.
- ``relay``: decoder output -> client response, keeping the OpenAI shapes.
- ``errors``: ``ProxyError``, the one error type of every non-2xx answer.
- ``models``: ``GET /v1/models``.
- ``openapi``: the OpenAPI 3.1 document at ``/openapi.json``.
- ``metrics``: the Prometheus metrics of one proxy app.
- ``app``: the HTTP routes (thin: parse, call the flow / registry / probes, answer).
- ``server``: ``kvoffload-proxy``: serve, shut down gracefully.
"""

__version__ = "0.1.0"
