"""The connectors' counters as vLLM connector stats and as Prometheus counters.

Each worker hands vLLM a ``CounterStats`` (sums since its last report) through
``get_kv_connector_stats``; vLLM adds up the workers' in the API server, logs them with its
periodic stats line and passes them to ``CounterPromMetrics``, which exposes every counter on the
server's ``/metrics`` as ``vllm:kvoffload_<connector>_<name>_total`` (with vLLM's engine labels).
vLLM's ``MultiConnector`` requires every child that reports stats to provide Prometheus metrics.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


class Counters:
    """Named sums, safe to add to from many threads; ``take`` returns them and starts again at 0."""

    def __init__(self, names: Iterable[str]) -> None:
        self._names = tuple(names)
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(self._names, 0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._values[k] += v  # KeyError for a name not declared

    def take(self) -> dict[str, float]:
        with self._lock:
            data, self._values = self._values, dict.fromkeys(self._names, 0)
        return data


@dataclass
class CounterStats(KVConnectorStats):
    """Counter sums since the last report (vLLM aggregates workers and logs them)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> CounterStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per name: ``vllm:kvoffload_<connector>_<name>_total``."""

    def __init__(
        self,
        vllm_config,
        metric_types,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        connector: str,
        counters: dict[str, str],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvoffload_{connector}_{name}_total", documentation=doc, labelnames=labelnames
            )
            for name, doc in counters.items()
        }
        for counter in self._counters.values():  # every series exported from the start, at 0: a reader
            for labels in per_engine_labelvalues.values():  # tells "none yet" from "not exported"
                counter.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in (transfer_stats_data or {}).items():
            counter = self._counters.get(name)
            if counter is not None and value:
                # vLLM types its counter class as any of its metric classes; it is the Counter one
                counter.labels(*labels).inc(value)  # type: ignore[union-attr]


class CountingConnector(ABC):
    """Mixin (before ``KVConnectorBase_V1`` in the bases) for a connector whose counters vLLM reports:
    the subclass names its Prometheus prefix (``prom_name``), declares its counters
    (``prom_counters``) and hands over the sums since the last report (``take_counters``)."""

    prom_name: ClassVar[str]

    @classmethod
    @abstractmethod
    def prom_counters(cls) -> dict[str, str]:
        """Counter name -> what it counts."""

    @abstractmethod
    def take_counters(self) -> dict[str, float]:
        """The sums since the last call."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.take_counters()
        return CounterStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return CounterStats(data=dict(data)) if data is not None else CounterStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> CounterPromMetrics:
        return CounterPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, cls.prom_name, cls.prom_counters()
        )
