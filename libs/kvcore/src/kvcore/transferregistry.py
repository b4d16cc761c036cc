"""The P→D transfer backends, one entry each: ``TRANSFERS`` (the SfaRemoteD2HConnector's
``transfer_backend`` name -> ``TransferBackend``); ``pdlink.engines`` starts an entry's engine.

An entry declares everything about its backend that lives outside the backend's own module: what it
needs (``ImportProbe``: the module and how to install it; ``needs``: what no import can tell), where
it runs (its ``PullPath`` on one host and across hosts: the name benches report it by and the
decode's counter of its reads), its engine factory, its own ``kv_connector_extra_config`` keys,
whether the vLLM connector takes it (else why not) and whether a loopback stack runs it. Config
validation (``kvcore.config.connectors``, ``kvcore.config.node``), availability (``kvcore.backends``),
both services and the vLLM connector (through ``pdlink.engines``), ``kvoffload up``, the fault
suite and ``kvoffload bench pd`` / ``bench vllm`` all read it.

The engine factory is named ``"module:attribute"`` and imported when used (``kvcore.pool.registry.load``):
kvcore cannot import pdlink (pdlink depends on kvcore), and nothing imports an optional engine's
library until it runs. This module imports neither pydantic nor torch: the command line reads the
names (``--transfer`` choices) without paying for either.

Adding a backend: its module in ``libs/pdlink`` (a ``pdlink.engine_rows.Transfer`` with a factory
``start_transfer(role, host, d2h)`` whose cannot-run errors are ``pdlink.engine_rows.EngineCannotRun``),
its entry below, and, when it has keys, their typed fields on ``kvcore.config.connectors.D2HConnectorConfig``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvcore.pool.registry import EMBEDDED, MOONCAKE_INSTALL, ImportProbe

MEMFABRIC_INSTALL = "install MemFabric: scripts/install-memcache (it runs `pip install memfabric_hybrid==1.3.0`)"


@dataclass(frozen=True)
class PullPath:
    """How a decode reads a prefill's rows on a backend: the name ``bench pd`` / ``bench vllm`` report
    the path by, and the decode's pull counter of those reads (``pdlink.pullcounters``)."""

    name: str
    counter: str


@dataclass(frozen=True)
class TransferBackend:
    """One P→D transfer backend (see the module docstring)."""

    name: str  # the D2H connector's "transfer_backend"
    summary: str  # what carries the rows, in a few words (messages quote it)
    one_host: PullPath | None  # its path when prefill and decode share a host; None: it does not run so
    across_hosts: PullPath | None  # its path across hosts; None: it does not run so
    # (role: "Prefill" | "Decode", host, d2h: D2HConnectorConfig | None) -> pdlink.engine_rows.Transfer;
    # None: the embedded data path (no engine: shared memory, the LayerSource gRPC stream)
    engine: str | None = None
    probe: ImportProbe | None = None  # the module it needs; None: nothing to install
    needs: str = ""  # what else it needs that no import can tell ("": nothing)
    keys: Mapping[str, str] = field(default_factory=dict)  # its own kv_connector_extra_config keys -> what each is
    vllm_refusal: str = ""  # why the vLLM connector does not take it; "": it does
    stack: bool = False  # a loopback stack runs it (StackConfig.transfer, `kvoffload bench --transfer`)


ENGINE_PATH = "reads_engine"  # the decode's counter of reads through a transfer engine

TRANSFERS: Mapping[str, TransferBackend] = MappingProxyType(
    {
        b.name: b
        for b in (
            TransferBackend(
                EMBEDDED,
                summary="the embedded P→D data path: shared memory on one host, gRPC streaming across hosts",
                one_host=PullPath("shared_memory", "reads_shared_memory"),
                across_hosts=PullPath("grpc_stream", "reads_streamed"),
                stack=True,
            ),
            # memfabric: whether its data path runs here (an Ascend NPU driver) is its construction's call
            TransferBackend(
                "memfabric",
                summary="memfabric_hybrid's TransferEngine between Ascend NPU hosts",
                one_host=PullPath("memfabric", ENGINE_PATH),
                across_hosts=PullPath("memfabric", ENGINE_PATH),
                engine="pdlink.memfabric:start_transfer",
                probe=ImportProbe("memfabric_hybrid", MEMFABRIC_INSTALL),
                needs="an Ascend NPU driver (TransferEngine.initialize says whether it runs here)",
                keys=MappingProxyType(
                    {
                        "memfabric_device_id": "the Ascend NPU memfabric's TransferEngine binds; default 0",
                        "memfabric_data_op": "memfabric's data operation; default 'sdma'",
                    }
                ),
                vllm_refusal="memfabric is a path of the kvoffload services only, for now",
            ),
            # mooncake: runs wherever mooncake.engine imports (no NPU), over TCP
            TransferBackend(
                "mooncake",
                summary="Mooncake Transfer Engine over TCP",
                one_host=PullPath("mooncake", ENGINE_PATH),
                across_hosts=PullPath("mooncake", ENGINE_PATH),
                engine="pdlink.mooncake_transfer:start_transfer",
                probe=ImportProbe("mooncake.engine", MOONCAKE_INSTALL),
                stack=True,
            ),
        )
    }
)
TRANSFER_NAMES: tuple[str, ...] = tuple(TRANSFERS)  # the config's "transfer_backend" choices
STACK_TRANSFERS: tuple[str, ...] = tuple(b.name for b in TRANSFERS.values() if b.stack)  # StackConfig.transfer
VLLM_TRANSFERS: tuple[str, ...] = tuple(b.name for b in TRANSFERS.values() if not b.vllm_refusal)
ENGINE_TRANSFERS: tuple[str, ...] = tuple(b.name for b in TRANSFERS.values() if b.engine)


def uses_engine(name: str | None) -> bool:
    """Whether transfer_backend ``name`` moves the rows through a transfer engine (not the embedded
    path); False for None and for a name the registry does not hold."""
    entry = TRANSFERS.get(name) if name is not None else None
    return entry is not None and entry.engine is not None


def either(names: Iterable[str]) -> str:
    """``'a', 'b' or 'c'``: the names quoted, for a message that lists the choices."""
    quoted = [repr(n) for n in names]
    if not quoted:
        return "none"
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
