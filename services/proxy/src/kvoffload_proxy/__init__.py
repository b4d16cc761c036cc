"""kvoffload-proxy: the OpenAI-compatible front door of the layerwise P/D deployment.

Decode first: a request goes to the least-loaded decoder with `kv_transfer_params.metaserver`
pointing back here; the decoder registers its endpoint at /v1/metaserver; the proxy then sends the
prompt to the least-loaded prefiller (max_tokens=1, the decoder's params) and answers the decoder
once that prefill completed; decoder tokens are relayed to the client.

Modules: config (flags -> ProxyConfig), balancer (least-loaded leases), metaserver (registration
rendezvous), upstream (backend calls, retries, error mapping), flow (one request end to end),
relay (OpenAI response shapes), app (routes), server (serve + graceful shutdown).
"""

__version__ = "0.1.0"
