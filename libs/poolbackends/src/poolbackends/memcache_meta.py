"""Start and stop a real Memcache MetaService (``memcache_hybrid.MetaService``) on loopback.

``MemcacheMetaService.start(MetaSettings())`` runs ``python -m poolbackends.memcache_meta CONF`` as a
child process: it imports ``memcache_hybrid`` and calls ``MetaService.main()`` with
``MMC_META_CONFIG_PATH=CONF``, as the seed does (``python -c "from memcache_hybrid import
MetaService; MetaService.main()"``). CONF is ``MetaSettings.meta_config`` when given, else an
``mmc-meta.conf`` generated from the settings (``poolbackends.memcache_conf.meta_conf_text``): the
RPC port, the config store port and the HTTP metrics port all bound to ``MetaSettings.host``
(127.0.0.1 unless told), free ports unless given. ``start`` returns once the service answers: its
HTTP ``/health`` says ``service_ready`` and its RPC and config store ports accept connections.
``stop()`` ends it (SIGTERM: it exits in about 3 s; SIGKILL after 10 s); the process handling is
``svcruntime.serverprocess.ServerProcess``'s. Its output and
the library's log files (``ock.mmc.log_path``) go to ``log_dir``.

Errors: ``MemcacheNotInstalled`` when ``memcache_hybrid`` cannot be imported (naming the module
and what to install); ``MemcacheMetaError`` when the child exits or does not answer in time (a
port already taken makes it exit), with the tail of its output. The MetaService itself runs on any
Linux x86_64 host: it needs no Ascend driver (the LocalService data path does, see
``poolbackends.memcache_client``).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

from kvcore.pool.host_pool import check_count, check_positive
from poolbackends.memcache_conf import MetaUrls, meta_conf_text, meta_urls
from svcruntime.serverprocess import ServerProcess, free_port, port_answers

MODULE = "memcache_hybrid"
INSTALL_HINT = (
    "install Memcache with `pip install memcache_hybrid==1.3.0` (it pulls memfabric_hybrid==1.3.0; "
    "or `pip install kvoffload-poolbackends[memcache]`); scripts/install-memcache does it"
)
NOT_INSTALLED_EXIT = 3  # exit code of the child when memcache_hybrid cannot be imported


class MemcacheNotInstalled(ImportError):
    """``memcache_hybrid`` (or the ``memfabric_hybrid`` it imports) cannot be imported."""


class MemcacheMetaError(RuntimeError):
    """The MetaService did not start, exited, or did not answer in time."""


@dataclass(frozen=True)
class MetaSettings:
    """How to run one MetaService. Ports 0 mean "pick a free one"; ``meta_config`` (a path to an
    ``mmc-meta.conf``) replaces the generated file and every port and host setting here."""

    host: str = "127.0.0.1"
    port: int = 0
    config_store_port: int = 0
    metrics_port: int = 0
    lease_ttl_ms: int = 30_000
    log_level: str = "info"
    meta_config: str | None = None
    start_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("port", "config_store_port", "metrics_port"):
            v = getattr(self, name)
            if not isinstance(v, int) or not (v == 0 or 1025 <= v <= 65535):
                raise ValueError(
                    f"{name} must be 0 (a free port) or a port in 1025..65535 (Memcache's range), got {v!r}"
                )
        check_count("lease_ttl_ms", self.lease_ttl_ms)
        check_positive("start_timeout_s", self.start_timeout_s)
        if self.meta_config is not None and not os.path.isfile(self.meta_config):
            raise ValueError(f"meta_config {self.meta_config!r} is not a file")


class MemcacheMetaService(ServerProcess):
    """One running MetaService child process (see the module docstring)."""

    START_ERROR = MemcacheMetaError
    STOP_GRACE_S = 10.0

    def __init__(self, settings: MetaSettings, conf_path: str, urls: MetaUrls, log_dir: str) -> None:
        super().__init__(log_dir, "meta-service.out", settings.start_timeout_s)
        self.settings = settings
        self.conf_path = conf_path
        self.urls = urls

    @classmethod
    def start(cls, settings: MetaSettings | None = None) -> MemcacheMetaService:
        """Start a MetaService and wait until it answers (``MemcacheMetaError`` past ``start_timeout_s``)."""
        s = settings or MetaSettings()
        picked = s.meta_config is None and 0 in (s.port, s.config_store_port, s.metrics_port)
        return cls.start_retrying(lambda: cls._prepare(s), 3 if picked else 1)  # a picked port may be taken

    @classmethod
    def _prepare(cls, s: MetaSettings) -> MemcacheMetaService:
        """A service of ``s`` not started yet: its log folder and (unless given) its generated conf."""
        log_dir = tempfile.mkdtemp(prefix="memcache-meta-")
        if s.meta_config is not None:
            conf = s.meta_config
        else:
            conf = os.path.join(log_dir, "mmc-meta.conf")
            with open(conf, "w") as f:
                f.write(
                    meta_conf_text(
                        host=s.host,
                        port=s.port or free_port(s.host),
                        config_store_port=s.config_store_port or free_port(s.host),
                        metrics_port=s.metrics_port or free_port(s.host),
                        lease_ttl_ms=s.lease_ttl_ms,
                        log_level=s.log_level,
                        log_dir=log_dir,
                    )
                )
        try:
            return cls(s, conf, meta_urls(conf), log_dir)
        except ValueError:
            shutil.rmtree(log_dir, ignore_errors=True)
            raise

    @property
    def meta_service_url(self) -> str:
        """``tcp://host:port``: ``ock.mmc.meta_service_url`` of every LocalService."""
        return self.urls.meta_service_url

    @property
    def config_store_url(self) -> str:
        """``tcp://host:port``: ``ock.mmc.local_service.config_store_url`` of every LocalService."""
        return self.urls.config_store_url

    @property
    def health_url(self) -> str:
        host = f"[{self.urls.metrics_host}]" if ":" in self.urls.metrics_host else self.urls.metrics_host
        return f"http://{host}:{self.urls.metrics_port}/health"

    def health(self) -> dict | None:
        """The JSON of ``/health`` (``service_ready``, ``status``, HA role...), None if it does not answer."""
        # http.client, not urllib: urllib sends "Connection: close", and then this server never sends the body
        conn = http.client.HTTPConnection(self.urls.metrics_host, self.urls.metrics_port, timeout=0.5)
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            return json.loads(r.read()) if r.status == 200 else None
        except (OSError, ValueError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    # ---- ServerProcess -------------------------------------------------------------------------

    @property
    def title(self) -> str:
        return f"the Memcache MetaService ({MODULE}.MetaService.main(), conf {self.conf_path})"

    @property
    def endpoint(self) -> str:
        return f"{self.meta_service_url} / {self.health_url}"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "poolbackends.memcache_meta", self.conf_path]

    def env(self) -> dict[str, str]:
        return dict(os.environ, MMC_META_CONFIG_PATH=self.conf_path)

    def ports(self) -> list[tuple[str, str, int]]:
        u = self.urls
        return [
            ("RPC", u.host, u.port),
            ("config store", u.host, u.config_store_port),
            ("metrics", u.metrics_host, u.metrics_port),
        ]

    def port_taken(self, what: str, host: str, port: int) -> str:
        return (
            f"cannot start the Memcache MetaService: its {what} port {host}:{port} is taken (another "
            f"MetaService?); pick another port ({self.conf_path})"
        )

    def exited(self, code: int) -> Exception | None:
        if code == NOT_INSTALLED_EXIT:
            return MemcacheNotInstalled(f"the Memcache MetaService cannot start: {self.log_tail()}")
        return None

    def answers(self) -> bool:
        """``/health`` says ``service_ready`` and the RPC and config store ports accept connections."""
        h = self.health()
        return (
            bool(h and h.get("service_ready"))
            and port_answers(self.urls.host, self.urls.port, 0.5)
            and port_answers(self.urls.host, self.urls.config_store_port, 0.5)
        )


def main(argv: list[str]) -> int:
    """``python -m poolbackends.memcache_meta CONF``: run a MetaService on CONF until SIGTERM."""
    if len(argv) != 1:
        print("usage: python -m poolbackends.memcache_meta MMC_META_CONF", file=sys.stderr)
        return 2
    os.environ["MMC_META_CONFIG_PATH"] = argv[0]  # before the import: the library reads it when it loads
    try:
        from memcache_hybrid import MetaService
    except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError (missing shared libraries)
        print(f"cannot import {MODULE}.MetaService ({type(e).__name__}: {e}); {INSTALL_HINT}", flush=True)
        return NOT_INSTALLED_EXIT
    return int(MetaService.main())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
