"""Security through real processes on loopback: every gRPC port of the stack (metastore, prefill data
port, decode control port) serves mTLS from --tls-cert/--tls-key/--tls-ca, every gRPC client
(prefill -> metastore, prefill -> decode, decode -> prefill LayerSource, the stack's probes) uses
them, and the proxy requires its API key. A completion through the proxy succeeds; a plain or
certificate-less gRPC client is refused; a client without the key gets 401."""

from __future__ import annotations

import urllib.error

import grpc
import pytest
import tlscerts  # test support on the root pytest pythonpath (needs cryptography, a test extra)

from kvoffload_testing.ports import DATA_PORT_OFFSET, free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import grpc_stats, healthy, post_json
from kvoffload_testing.stack_config import ensure_tiny_model
from svcruntime.tls import TLSConfig

pytestmark = pytest.mark.stack

KEY = "integration-key"


def test_mtls_on_every_grpc_port_and_api_key_on_the_proxy(tmp_path):
    pki = tlscerts.make_pki(tmp_path / "pki")
    tls = TLSConfig.load(pki.cert, pki.key, pki.ca)
    cfg = StackConfig(
        model=ensure_tiny_model(tmp_path / "tiny"),
        log_dir=tmp_path / "logs",
        **free_stack_ports(),
        max_model_len=4096,
        block_size=16,
        tls=tls,
        api_key=KEY,
        # another "host": the decode streams every layer from the prefill's LayerSource (gRPC)
        service_env={"prefill-0": {"KVOFFLOAD_HOST_ID": "prefill-host"}},
    )
    assert "--api-key" not in str(Stack(cfg).commands())  # the key travels in the environment, not argv
    body = {"prompt": "secure " * 40, "max_tokens": 4, "temperature": 0}
    with Stack(cfg) as s:
        with pytest.raises(urllib.error.HTTPError) as refused:
            post_json(f"{s.url}/v1/completions", body)
        assert refused.value.code == 401
        got = post_json(f"{s.url}/v1/completions", body, headers=s.auth_headers)
        assert len(got["choices"][0]["token_ids"]) == 4

        metastore = f"{cfg.host}:{cfg.metastore_port}"
        grpc_ports = {
            "metastore": metastore,
            "prefill-0": f"{cfg.host}:{cfg.prefill_ports[0] + DATA_PORT_OFFSET}",
            "decode-0": f"{cfg.host}:{cfg.kv_port}",
        }
        assert healthy(f"grpc://{metastore}", tls)
        assert not healthy(f"grpc://{metastore}")  # a plain gRPC health probe is refused
        assert not healthy(f"grpc://{metastore}", TLSConfig.load(ca=pki.ca))  # TLS without a client certificate
        assert not healthy(f"grpc://{metastore}", TLSConfig.load(pki.other_cert, pki.other_key, pki.ca))
        stats = {name: grpc_stats(target, tls=tls) for name, target in grpc_ports.items()}
        for name, target in grpc_ports.items():
            with pytest.raises(grpc.RpcError) as plain:
                grpc_stats(target, timeout_s=3)
            assert plain.value.code() == grpc.StatusCode.UNAVAILABLE, name
    d = stats["decode-0"]
    assert d["read_done"] > 0 and d["reads_streamed"] > 0 and d["reads_shared_memory"] == 0  # pulled over TLS
    assert stats["prefill-0"]["held_slots"] == 0
    for name in ("metastore", "prefill-0", "decode-0"):
        log = (cfg.log_dir / f"{name}.log").read_text()
        assert '"mtls": true' in log or '"tls": "mtls"' in log, name
