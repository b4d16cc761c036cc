"""Parsing of the JSON users write: ``--kv-transfer-config`` and ``--additional-config``.

The formats are the ones of vllm-ascend's "Layerwise and Sparse KV Cache Offload" guide, accepted
as written (Ascend backend names included; whether a backend can run here is ``kvcore.backends``'
job, model-dependent rules are ``kvcore.settings``'). Parsed configs are frozen, strictly typed
pydantic models. Every problem found in one pass is raised together as a ``ConfigError`` whose
messages name the field by dotted path, the offending value and the rule. Unknown keys are not
errors: they become warnings (with a "did you mean" suggestion) kept on the parsed object and
logged once.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

import structlog
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

_log = structlog.get_logger(__name__)

Loc = tuple[Union[str, int], ...]
Problem = tuple[Loc, str]

STORE_CONNECTOR = "AscendStoreConnector"
D2H_CONNECTOR = "SfaRemoteD2HConnector"
MULTI_CONNECTOR = "MultiConnector"
CONNECTORS = (STORE_CONNECTOR, D2H_CONNECTOR, MULTI_CONNECTOR)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
STORE_BACKENDS = ("kvoffload", "memcache", "mooncake")
TRANSFER_BACKENDS = ("kvoffload", "memfabric")
# memfabric_hybrid.TransDataOpType members, lower-case (its TransferEngine's data operation; the
# library's default is SDMA)
MEMFABRIC_DATA_OPS = ("sdma", "host_rdma", "device_rdma", "device_urma", "device_uboe")
HOT_CACHE_POLICIES = ("lru", "slru")  # == kvcore.hotcache.POLICIES (config imports no engine code)
LAYERWISE_KEYS = ("layerwise_num_shared_buffers", "layerwise_independent_layers", "layerwise_prefetch_layers")
SPARSE_KEY = "sparse_kv_offload_config"

# Keys of vLLM's own KVTransferConfig: accepted silently (vLLM consumes them), not stored here.
_VLLM_TRANSFER_KEYS = frozenset(
    {
        "engine_id",
        "kv_buffer_device",
        "kv_buffer_size",
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_connector_module_path",
        "enable_permute_local_kv",
        "kv_load_failure_policy",
    }
)

_RULE = "kvoffload_rule"
_REQUIRED_RULES = {
    "kv_connector": "must be one of " + ", ".join(map(repr, CONNECTORS)),
    "kv_role": "must be one of " + ", ".join(map(repr, ROLES)),
    "backend": "must be one of " + ", ".join(map(repr, STORE_BACKENDS)),
    "connectors": "must be a non-empty list of connector configs",
}


class ConfigError(ValueError):
    """A configuration is invalid; ``errors`` lists every problem found (message = them joined by "; ")."""

    def __init__(self, errors: str | Sequence[str]) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("; ".join(self.errors))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errors,))

    @classmethod
    def from_validation_error(cls, exc: ValidationError, root: str) -> "ConfigError":
        """Friendly messages (``path: got ...; rule``) of a pydantic ValidationError."""
        return cls([f"{format_path(loc, root)}: {message}" for loc, message in problems_of(exc)])


def describe_value(value: Any) -> str:
    """``True (bool)``, ``'10GB' (str)``: the value and its Python type, for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def format_path(loc: Iterable[str | int], root: str) -> str:
    """``('a', 'connectors', 1, 'b')`` -> ``a.connectors[1].b``; the empty path -> ``root``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or root


def suggest(word: object, options: Iterable[str], cutoff: float = 0.6) -> str:
    """``"did you mean 'x'?"`` for the closest option (difflib), or ``""`` when none is close."""
    if not isinstance(word, str):
        return ""
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=cutoff)
    return f"did you mean {matches[0]!r}?" if matches else ""


def _hint(word: object, options: Iterable[str], sep: str) -> str:
    text = suggest(word, options)
    return f"{sep}{text}" if text else ""


def _rules(problems: Sequence[Problem]) -> PydanticCustomError:
    """A pydantic error carrying our problems (paths relative to where it is raised)."""
    message = "; ".join(f"{format_path(loc, '.')}: {text}" if loc else text for loc, text in problems)
    return PydanticCustomError(_RULE, "{message}", {"message": message, "problems": list(problems)})


def _rule(text: str) -> PydanticCustomError:
    return _rules([((), text)])


def problems_of(exc: ValidationError) -> list[Problem]:
    """Every problem of a ValidationError as (absolute loc, friendly message)."""
    out: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == _RULE:
            out.extend((loc + tuple(rel), text) for rel, text in err["ctx"]["problems"])
        else:
            out.append((loc, _generic_message(err)))
    return out


def _generic_message(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    if kind == "missing":
        rule = _REQUIRED_RULES.get(str(err["loc"][-1]) if err["loc"] else "", "")
        return "required key is missing" + (f"; {rule}" if rule else "")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"got {describe_value(err['input'])}; must be a JSON object"
    return f"got {describe_value(err['input'])}; {err['msg']}"


# ----------------------------------------------------------------------------------------------
# field rules (before-validators raising friendly errors; strict: no coercion at all)


def _choice(options: tuple[str, ...], what: str = "", *, optional: bool = False) -> BeforeValidator:
    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, str) and value in options:
            return value
        listed = ", ".join(map(repr, options))
        raise _rule(f"got {describe_value(value)}; must be one of {what}{listed}{_hint(value, options, '; ')}")

    return BeforeValidator(check)


def _int_rule(minimum: int, maximum: int | None = None, *, optional: bool = False) -> BeforeValidator:
    """An int (bool rejected, no coercion) in [minimum, maximum]; None too when optional."""
    bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    rule = f"must be an int {bound}" + (" or null" if optional else "")

    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        in_range = isinstance(value, int) and minimum <= value and (maximum is None or value <= maximum)
        if in_range and not isinstance(value, bool):
            return value
        raise _rule(f"got {describe_value(value)}; {rule}")

    return BeforeValidator(check)


def _strict_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _rule(f"got {describe_value(value)}; must be true or false")


def _independent_layers(value: Any) -> Any:
    if value == "all":
        return "all"
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    rule = 'must be "all" or a list of ints (layer indices; negatives count from the end)'
    raise _rule(f"got {describe_value(value)}; {rule}")


def _dram_gib(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise _rule(f"got {describe_value(value)}; must be whole GiB as an integer > 0 (e.g. 128, not 1.5 or \"10GB\")")


def _address(what: str) -> BeforeValidator:
    """``"HOST:PORT"`` (port 1..65535) or None; ``what`` names whose address it is."""

    def check(value: Any) -> Any:
        if value is None:
            return None
        host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        if sep and host and port.isdigit() and 1 <= int(port) <= 65535:
            return value
        raise _rule(f"got {describe_value(value)}; must be \"HOST:PORT\" ({what})")

    return BeforeValidator(check)


def _namespace(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str) and value and "/" not in value and value.strip() == value:
        return value
    raise _rule(f"got {describe_value(value)}; must be a non-empty string without '/' or surrounding spaces")


def _host(value: Any) -> Any:
    if value is None:
        return None
    wildcard = value in ("0.0.0.0", "::", "[::]") if isinstance(value, str) else False
    with_port = isinstance(value, str) and value.count(":") == 1  # "host:port" (IPv6 has more colons)
    if isinstance(value, str) and value.strip() == value and value and not wildcard and not with_port:
        return value
    raise _rule(f"got {describe_value(value)}; must be a host name or address the peers can reach, without a "
                "port (not a wildcard such as 0.0.0.0)")


def _positive_seconds(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise _rule(f"got {describe_value(value)}; must be a number of seconds > 0")


def _positive_gib(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise _rule(f"got {describe_value(value)}; must be a number of GiB > 0 (e.g. 1 or 0.5)")


StrictBool = Annotated[bool, BeforeValidator(_strict_bool)]


# ----------------------------------------------------------------------------------------------
# models


class _Model(BaseModel):
    """Frozen, strict model; unknown keys become warnings, cross-field problems join field ones."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    _ROOT: ClassVar[str] = "config"
    _SILENT_KEYS: ClassVar[frozenset[str]] = frozenset()
    _warning_items: list[Problem] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _validate_all(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        if not isinstance(data, dict):
            return handler(data)
        problems = cls._raw_problems(data)
        try:
            model = handler(data)
        except ValidationError as exc:
            raise _rules(problems_of(exc) + problems) from None
        if problems:
            raise _rules(problems)
        model._warning_items = [((), text) for text in cls._unknown_key_warnings(data)] + model._own_warnings()
        return model

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        """Cross-field problems visible on the raw input (reported with the field errors)."""
        return []

    @classmethod
    def _unknown_key_warnings(cls, data: Mapping[Any, Any]) -> list[str]:
        known = list(cls.model_fields)
        accepted = set(known) | cls._SILENT_KEYS
        return [
            f"unknown key {key!r} (ignored);{_hint(key, sorted(accepted), ' ')} known keys: {', '.join(known)}"
            for key in data
            if key not in accepted
        ]

    def _own_warnings(self) -> list[Problem]:
        return []

    def _children(self) -> Iterable[tuple[Loc, "_Model"]]:
        return ()

    def warning_items(self) -> list[Problem]:
        """Warnings of this object and every nested one, as (loc relative to this object, text)."""
        items = list(self._warning_items)
        for loc, child in self._children():
            items.extend((loc + rel, text) for rel, text in child.warning_items())
        return items

    @property
    def warnings(self) -> list[str]:
        """Warnings of this object and nested ones, each prefixed with its dotted path."""
        return [f"{format_path(loc, self._ROOT)}: {text}" for loc, text in self.warning_items()]


class StoreConnectorConfig(_Model):
    """``kv_connector_extra_config`` of an AscendStoreConnector (host KV pool + layerwise offload)."""

    _ROOT: ClassVar[str] = "kv_connector_extra_config"

    backend: Annotated[str, _choice(STORE_BACKENDS)]
    use_layerwise: StrictBool = False
    layerwise_num_shared_buffers: Annotated[int | None, _int_rule(1, optional=True)] = None
    layerwise_independent_layers: Annotated[
        Union[Literal["all"], tuple[int, ...]], BeforeValidator(_independent_layers)
    ] = (0,)
    layerwise_prefetch_layers: Annotated[int | None, _int_rule(1, optional=True)] = None
    # backend "kvoffload": the metastore indexing the pool (the reference prefill also takes --metastore)
    metastore: Annotated[str | None, _address("the kvoffload-metastore's address")] = None
    # every backend: the host memory this node contributes (the reference prefill also takes --host-pool-gb)
    host_pool_gb: Annotated[float | None, BeforeValidator(_positive_gib)] = None
    # backend "mooncake": the mooncake_master, the key namespace pools share, the master's lease TTL
    mooncake_master: Annotated[str | None, _address("the mooncake_master's RPC address")] = None
    mooncake_namespace: Annotated[str, BeforeValidator(_namespace)] = "kvoffload"
    mooncake_lease_ttl_ms: Annotated[int, _int_rule(1)] = 5_000  # the master's --default_kv_lease_ttl

    # keys that belong to one backend: key -> (that backend, what it is for); with another backend,
    # giving one is an error. (``metastore`` is refused by "mooncake" only: a memcache config may
    # carry it, as before, and is refused at start-up anyway.)
    BACKEND_KEYS: ClassVar[dict[str, tuple[str, str]]] = {
        "mooncake_master": ("mooncake", "the mooncake backend's master"),
        "mooncake_namespace": ("mooncake", "the mooncake backend's key namespace"),
        "mooncake_lease_ttl_ms": ("mooncake", "the mooncake backend's lease TTL"),
        "metastore": ("kvoffload", "the kvoffload-metastore that indexes the embedded pool; the mooncake backend "
                                   "keeps its index in the mooncake_master"),
    }

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        backend = data.get("backend")
        if backend not in STORE_BACKENDS:
            return []  # the backend itself is reported
        problems: list[Problem] = []
        if backend == "mooncake" and data.get("mooncake_master") is None:
            problems.append((("mooncake_master",), "required with backend 'mooncake'; must be \"HOST:PORT\" (the "
                                                   "mooncake_master's RPC address, e.g. \"127.0.0.1:50051\")"))
        for key, (owner, what) in cls.BACKEND_KEYS.items():
            refused = backend != owner and (owner == "mooncake" or backend == "mooncake")
            if data.get(key) is not None and refused:
                problems.append(((key,), f"applies to backend {owner!r} only ({what}), not {backend!r}; remove it"))
        return problems

    def _own_warnings(self) -> list[Problem]:
        if self.use_layerwise:
            return []
        return [
            ((key,), "has no effect while use_layerwise is false (set use_layerwise: true to use it)")
            for key in LAYERWISE_KEYS
            if key in self.model_fields_set
        ]


class D2HConnectorConfig(_Model):
    """``kv_connector_extra_config`` of an SfaRemoteD2HConnector (remote P→D device-to-host pull)."""

    _ROOT: ClassVar[str] = "kv_connector_extra_config"

    transfer_backend: Annotated[str | None, _choice(TRANSFER_BACKENDS, optional=True)] = None
    use_layerwise: StrictBool = False
    # read by the vLLM connector (kvoffload_vllm); the reference services take them as flags
    advertise_host: Annotated[str | None, BeforeValidator(_host)] = None  # where peers reach this engine
    data_port: Annotated[int | None, _int_rule(0, 65535, optional=True)] = None  # producer's LayerSource; 0: any
    peer_timeout_s: Annotated[float | None, BeforeValidator(_positive_seconds)] = None
    # transfer_backend "memfabric" only: TransferEngine.initialize's device_id and data_op_type
    memfabric_device_id: Annotated[int, _int_rule(0)] = 0
    memfabric_data_op: Annotated[str, _choice(MEMFABRIC_DATA_OPS)] = "sdma"

    VLLM_ONLY: ClassVar[dict[str, str]] = {"advertise_host": "--advertise-host", "data_port": "--data-port",
                                           "peer_timeout_s": "--peer-timeout-s"}
    # keys of transfer_backend "memfabric": key -> what it is (with its default); refused with "kvoffload"
    MEMFABRIC_KEYS: ClassVar[dict[str, str]] = {
        "memfabric_device_id": "the Ascend NPU memfabric's TransferEngine binds; default 0",
        "memfabric_data_op": "memfabric's data operation; default 'sdma'",
    }

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        backend = data.get("transfer_backend")
        if backend == "memfabric" or backend not in TRANSFER_BACKENDS:
            return []  # a missing or unknown transfer_backend is reported on its own
        return [((key,), f"applies to transfer_backend 'memfabric' only ({what}), not {backend!r}; remove it")
                for key, what in cls.MEMFABRIC_KEYS.items() if key in data]

    def vllm_only_problems(self, prefix: str = "") -> list[str]:
        """The vLLM-connector keys this config sets, as errors naming the reference service's flag."""
        return [f"{prefix}kv_connector_extra_config.{key}: read by the vLLM connector only; the kvoffload "
                f"services take {flag} instead" for key, flag in self.VLLM_ONLY.items() if key in self.model_fields_set]


class MultiConnectorConfig(_Model):
    """``kv_connector_extra_config`` of a MultiConnector: one child config per connector type."""

    _ROOT: ClassVar[str] = "kv_connector_extra_config"

    connectors: tuple["KVTransferConfig", ...]

    @field_validator("connectors", mode="before")
    @classmethod
    def _non_empty_list(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and value:
            return tuple(value)
        raise _rule(f"got {describe_value(value)}; must be a non-empty list of connector configs")

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        children = data.get("connectors")
        if not isinstance(children, (list, tuple)):
            return []
        problems: list[Problem] = []
        seen: dict[str, int] = {}
        for i, child in enumerate(children):
            name = child.get("kv_connector") if isinstance(child, dict) else None
            loc: Loc = ("connectors", i, "kv_connector")
            if name == MULTI_CONNECTOR:
                problems.append((loc, "got 'MultiConnector'; a MultiConnector cannot contain another MultiConnector"))
            elif isinstance(name, str) and name in seen:
                text = f"got {name!r} again (also connectors[{seen[name]}]); at most one connector of each type"
                problems.append((loc, text))
            elif isinstance(name, str):
                seen[name] = i
        return problems

    def _children(self) -> Iterable[tuple[Loc, _Model]]:
        return ((("connectors", i), child) for i, child in enumerate(self.connectors))


_EXTRA_MODELS: dict[str, type[_Model]] = {
    STORE_CONNECTOR: StoreConnectorConfig,
    D2H_CONNECTOR: D2HConnectorConfig,
    MULTI_CONNECTOR: MultiConnectorConfig,
}
ExtraConfig = Union[StoreConnectorConfig, D2HConnectorConfig, MultiConnectorConfig]


class KVTransferConfig(_Model):
    """``--kv-transfer-config``: connector, role, base port and the connector's typed extra config."""

    _ROOT: ClassVar[str] = "kv_transfer_config"
    _SILENT_KEYS: ClassVar[frozenset[str]] = _VLLM_TRANSFER_KEYS

    kv_connector: Annotated[str, _choice(CONNECTORS, "the supported connectors ")]
    kv_role: Annotated[str, _choice(ROLES)]
    kv_port: Annotated[int | None, _int_rule(1, 65535, optional=True)] = None
    kv_connector_extra_config: ExtraConfig = Field(default_factory=dict, validate_default=True)

    @field_validator("kv_connector_extra_config", mode="before")
    @classmethod
    def _typed_extra(cls, value: Any, info: ValidationInfo) -> Any:
        connector = info.data.get("kv_connector")
        if connector is None:
            raise _rules([])  # kv_connector itself is reported; nothing to type this against
        model_cls = _EXTRA_MODELS[connector]
        if isinstance(value, model_cls):
            return value
        try:
            return model_cls.model_validate({} if value is None else value)
        except ValidationError as exc:
            raise _rules(problems_of(exc)) from None

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        role = data.get("kv_role")
        extra = data.get("kv_connector_extra_config")
        if data.get("kv_connector") != MULTI_CONNECTOR or role not in ROLES or not isinstance(extra, dict):
            return []
        children = extra.get("connectors")
        if not isinstance(children, (list, tuple)):
            return []
        return [
            (
                ("kv_connector_extra_config", "connectors", i, "kv_role"),
                f"got {child['kv_role']!r}; must equal the MultiConnector's kv_role {role!r}",
            )
            for i, child in enumerate(children)
            if isinstance(child, dict) and child.get("kv_role") in ROLES and child["kv_role"] != role
        ]

    def _children(self) -> Iterable[tuple[Loc, _Model]]:
        return ((("kv_connector_extra_config",), self.kv_connector_extra_config),)

    @property
    def leaves(self) -> tuple["KVTransferConfig", ...]:
        """The non-Multi connector configs: the children of a MultiConnector, else ``(self,)``."""
        extra = self.kv_connector_extra_config
        return extra.connectors if isinstance(extra, MultiConnectorConfig) else (self,)

    def locate(self, kv_connector: str) -> tuple[str, "KVTransferConfig"] | None:
        """(dotted path prefix, config) of the connector of that type (self or a child), else None.

        The prefix is ``""`` for self and ``kv_connector_extra_config.connectors[i].`` for a child.
        """
        if self.kv_connector == kv_connector:
            return "", self
        extra = self.kv_connector_extra_config
        if isinstance(extra, MultiConnectorConfig):
            for i, child in enumerate(extra.connectors):
                if child.kv_connector == kv_connector:
                    return f"kv_connector_extra_config.connectors[{i}].", child
        return None

    @property
    def store(self) -> StoreConnectorConfig | None:
        """The AscendStoreConnector's extra config (of self or of a child), or None."""
        found = self.locate(STORE_CONNECTOR)
        extra = found[1].kv_connector_extra_config if found else None
        return extra if isinstance(extra, StoreConnectorConfig) else None

    @property
    def d2h(self) -> "KVTransferConfig | None":
        """The SfaRemoteD2HConnector config (self or child, with its kv_port), or None."""
        found = self.locate(D2H_CONNECTOR)
        return found[1] if found else None

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


MultiConnectorConfig.model_rebuild()


class SparseKVOffloadConfig(_Model):
    """``sparse_kv_offload_config`` of ``--additional-config`` (decode-side sparse offload)."""

    _ROOT: ClassVar[str] = SPARSE_KEY

    enabled: StrictBool = False
    topk_buffer_size: Annotated[int, _int_rule(1)] = 4096
    dram_size_per_dp_GB: Annotated[int, BeforeValidator(_dram_gib)] = 128
    keep_device_kv_cache: StrictBool = False
    # kvoffload's own key: the hot cache's replacement policy (kvcore.hotcache.POLICIES)
    hot_cache_policy: Annotated[str, _choice(HOT_CACHE_POLICIES)] = "lru"
    # kvoffload's own key: load the next layer's predicted misses while a layer runs
    miss_prefetch: StrictBool = False

    @property
    def dram_bytes_per_dp(self) -> int:
        """Host pool bytes per DP rank (``dram_size_per_dp_GB`` GiB)."""
        return self.dram_size_per_dp_GB * 2**30


class AdditionalConfig(_Model):
    """``--additional-config``: this feature's ``sparse_kv_offload_config``; other keys belong to
    other features and are kept (``model_extra``) without warnings unless they look like a typo."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)
    _ROOT: ClassVar[str] = "additional_config"

    sparse_kv_offload_config: SparseKVOffloadConfig = Field(default_factory=SparseKVOffloadConfig)

    @classmethod
    def _unknown_key_warnings(cls, data: Mapping[Any, Any]) -> list[str]:
        return [
            f"unknown key {key!r} (ignored); did you mean {SPARSE_KEY!r}?"
            for key in data
            if isinstance(key, str)
            and key != SPARSE_KEY
            and difflib.SequenceMatcher(None, key, SPARSE_KEY).ratio() >= 0.8
        ]

    def _children(self) -> Iterable[tuple[Loc, _Model]]:
        return (((SPARSE_KEY,), self.sparse_kv_offload_config),)

    @property
    def sparse(self) -> SparseKVOffloadConfig:
        return self.sparse_kv_offload_config


# ----------------------------------------------------------------------------------------------
# entry points


def _load_json(value: Any, option: str) -> Any:
    if isinstance(value, (dict, list)):
        return value
    if not isinstance(value, str):
        raise ConfigError([f"{option}: got {describe_value(value)}; must be a JSON string or a dict"])
    try:
        return json.loads(value, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"{option}: malformed JSON at line {exc.lineno} column {exc.colno} (char {exc.pos}): {exc.msg}"]
        ) from None
    except _DuplicateKey as exc:
        raise ConfigError(
            [f"{option}: key {exc.args[0]!r} appears twice in one JSON object; give each key once"]
        ) from None


class _DuplicateKey(ValueError):
    """A JSON object names a key twice (json.loads would silently keep the last value)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _validate(model_cls: type[_Model], data: Any, option: str) -> Any:
    try:
        model = model_cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, model_cls._ROOT) from None
    _log_warnings(model, option)
    return model


def _log_warnings(model: _Model, option: str) -> None:
    items = model.warning_items()
    unknown = [f"{format_path(loc, model._ROOT)}: {text}" for loc, text in items if text.startswith("unknown key ")]
    other = [f"{format_path(loc, model._ROOT)}: {text}" for loc, text in items if not text.startswith("unknown key ")]
    if unknown:
        _log.warning("unknown_config_keys", option=option, warnings=unknown)
    if other:
        _log.warning("ineffective_config_keys", option=option, warnings=other)


def parse_kv_transfer_config(value: str | dict[str, Any], *, strict: bool = False) -> KVTransferConfig:
    """Parse ``--kv-transfer-config`` (JSON string or dict); ConfigError lists every problem.

    Unknown keys are logged warnings, or with ``strict`` (our vLLM connectors: nothing else reads
    their extra config) problems of the ConfigError."""
    data = _load_json(value, "--kv-transfer-config")
    model = _validate(KVTransferConfig, data, "--kv-transfer-config")
    unknown = [w for loc, text in model.warning_items() if text.startswith("unknown key ")
               for w in [f"{format_path(loc, model._ROOT)}: {text.replace(' (ignored)', '')}"]]
    if strict and unknown:
        raise ConfigError(unknown)
    return model


def parse_additional_config(value: str | dict[str, Any] | None) -> AdditionalConfig:
    """Parse ``--additional-config`` (JSON string, dict, or None/empty for defaults)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        value = {}
    data = _load_json(value, "--additional-config")
    return _validate(AdditionalConfig, data, "--additional-config")
