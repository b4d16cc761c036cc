"""``--kv-transfer-config``: ``KVTransferConfig`` (connector, role, base port and the connector's
typed extra config) and ``MultiConnectorConfig`` (one child config per connector type), with the
lookups of a connector inside a MultiConnector.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from kvcore.config.connectors import D2HConnectorConfig, StoreConnectorConfig
from kvcore.config.errors import Loc, Problem, describe_value, problems_of, rule_error, rules_error
from kvcore.config.fields import choice, int_rule
from kvcore.config.model import ConfigModel
from kvcore.config.names import (
    CONNECTORS,
    D2H_CONNECTOR,
    MULTI_CONNECTOR,
    ROLES,
    STORE_CONNECTOR,
    VLLM_TRANSFER_KEYS,
)


class MultiConnectorConfig(ConfigModel):
    """``kv_connector_extra_config`` of a MultiConnector: one child config per connector type."""

    _ROOT: ClassVar[str] = "kv_connector_extra_config"

    connectors: tuple[KVTransferConfig, ...]

    @field_validator("connectors", mode="before")
    @classmethod
    def _non_empty_list(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and value:
            return tuple(value)
        raise rule_error(f"got {describe_value(value)}; must be a non-empty list of connector configs")

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

    def _children(self) -> Iterable[tuple[Loc, ConfigModel]]:
        return ((("connectors", i), child) for i, child in enumerate(self.connectors))


_EXTRA_MODELS: dict[str, type[ConfigModel]] = {
    STORE_CONNECTOR: StoreConnectorConfig,
    D2H_CONNECTOR: D2HConnectorConfig,
    MULTI_CONNECTOR: MultiConnectorConfig,
}
ExtraConfig = StoreConnectorConfig | D2HConnectorConfig | MultiConnectorConfig


class KVTransferConfig(ConfigModel):
    """``--kv-transfer-config``: connector, role, base port and the connector's typed extra config."""

    _ROOT: ClassVar[str] = "kv_transfer_config"
    _SILENT_KEYS: ClassVar[frozenset[str]] = VLLM_TRANSFER_KEYS

    kv_connector: Annotated[str, choice(CONNECTORS, "the supported connectors ")]
    kv_role: Annotated[str, choice(ROLES)]
    kv_port: Annotated[int | None, int_rule(1, 65535, optional=True)] = None
    kv_connector_extra_config: ExtraConfig = Field(default_factory=dict, validate_default=True)

    @field_validator("kv_connector_extra_config", mode="before")
    @classmethod
    def _typed_extra(cls, value: Any, info: ValidationInfo) -> Any:
        connector = info.data.get("kv_connector")
        if connector is None:
            raise rules_error([])  # kv_connector itself is reported; nothing to type this against
        model_cls = _EXTRA_MODELS[connector]
        if isinstance(value, model_cls):
            return value
        try:
            return model_cls.model_validate({} if value is None else value)
        except ValidationError as exc:
            raise rules_error(problems_of(exc)) from None

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

    def _children(self) -> Iterable[tuple[Loc, ConfigModel]]:
        return ((("kv_connector_extra_config",), self.kv_connector_extra_config),)

    @property
    def leaves(self) -> tuple[KVTransferConfig, ...]:
        """The non-Multi connector configs: the children of a MultiConnector, else ``(self,)``."""
        extra = self.kv_connector_extra_config
        return extra.connectors if isinstance(extra, MultiConnectorConfig) else (self,)

    def locate(self, kv_connector: str) -> tuple[str, KVTransferConfig] | None:
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
    def d2h(self) -> KVTransferConfig | None:
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
