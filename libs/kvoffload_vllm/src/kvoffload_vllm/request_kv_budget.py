"""The budget of the host copies (``kvoffload_vllm.request_kv``): its size, the start-up check, and
the scheduler's admission of requests against it.

A vLLM prefill on shared layer buffers keeps a host copy of every running request's blocks of the
shared layers until vLLM finishes the request. The store's ``layerwise_request_kv_gb`` bounds those
copies for the whole engine (its TP ranks together; each rank gets its share); unset, it is a quarter
of the memory available when the engine starts (``MemAvailable``, or its cgroup's room where smaller).

A request's worst case is ceil(min(prompt + max_tokens, max_model_len) / block_size) blocks × shared
layers × a layer's block bytes (its caches side by side: a DSA layer's indexer cache with it) × TP
ranks: its copies never grow past it.

- **Start-up** (``BudgetSize.check``): one request of ``max_model_len`` must fit, or a request vLLM
  accepts could never run: a ``ConfigError`` naming the key, the sizes and the fixes. When
  ``max_num_seqs`` such requests do not fit, a warning names the key: the others wait.
- **Scheduler** (``HostCopyAdmission``): a request is admitted when its worst case fits next to those
  admitted, in order (a request waiting for room is not overtaken by a later one); otherwise
  ``get_num_new_matched_tokens`` answers None and vLLM asks again at a later step
  (``kvoffload_request_kv_wait`` names the key, once per request). A finished request's room is free
  for the next step, whose metadata (``HostCopies``) tells the workers to drop its copy before they
  reserve. Every request fits alone (the start-up check), so a wait ends when the requests admitted
  before it finish: never refused at run time, never a hang, never past the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from kvcore.config.errors import ConfigError
from kvcore.layout import physical_index
from kvoffload_vllm.request_kv import BUDGET_KEY

if TYPE_CHECKING:
    from kvcore.config.connectors import StoreConnectorConfig
    from kvoffload_vllm.kv_groups import KVGroup
    from kvoffload_vllm.shared_buffers import SharedBuffers

log = structlog.get_logger("vllm.kvoffload.store")

DEFAULT_FRACTION = 0.25  # of the memory available at start-up, when the key is not given
GIB = 1 << 30


def available_bytes(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process could still take: ``MemAvailable``, or less where its cgroup (v2) says so."""
    info = dict(line.split(":", 1) for line in (proc / "meminfo").read_text().splitlines() if ":" in line)
    avail = int(info["MemAvailable"].split()[0]) * 1024
    try:
        path = (proc / "self" / "cgroup").read_text().splitlines()[0].split("::", 1)[1].strip().lstrip("/")
        limit = (cgroup_root / path / "memory.max").read_text().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int((cgroup_root / path / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):  # no cgroup v2 here: MemAvailable alone
        pass
    return max(avail, 0)


@dataclass(frozen=True)
class BudgetSize:
    """The budget and what one block position of a request costs on the host (every shared layer,
    every rank)."""

    budget_bytes: int
    source: str
    shared_layers: int
    row_bytes: int  # one layer's block on one rank: its caches' pages side by side (the widest layer's)
    ranks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int

    @property
    def block_bytes(self) -> int:
        return self.shared_layers * self.row_bytes * self.ranks

    def blocks(self, tokens: int) -> int:
        """Block positions a request of ``tokens`` (prompt + max_tokens) can ever hold."""
        return math.ceil(min(tokens, self.max_model_len) / self.block_size)

    @property
    def per_request_bytes(self) -> int:
        """One request of ``max_model_len``."""
        return self.blocks(self.max_model_len) * self.block_bytes

    @property
    def worst_case_bytes(self) -> int:
        return self.max_num_seqs * self.per_request_bytes

    def check(self) -> None:
        """ConfigError when one request of max_model_len cannot fit; a warning when max_num_seqs cannot."""
        one, gib = self.per_request_bytes, lambda n: f"{n / GIB:.3g} GiB"
        if self.budget_bytes < one:
            raise ConfigError(
                [
                    f"kv_connector_extra_config.{BUDGET_KEY}: the host copies of running requests get "
                    f"{gib(self.budget_bytes)} ({self.source}); one request of max_model_len {self.max_model_len} "
                    f"needs {gib(one)} ({self.blocks(self.max_model_len)} blocks × {self.shared_layers} shared "
                    f"layers × {self.row_bytes} bytes × {self.ranks} rank(s)), so it could never run: set "
                    f"{BUDGET_KEY} to at least {math.ceil(one / GIB * 1000) / 1000} or lower --max-model-len"
                ]
            )
        fit = self.budget_bytes // one
        if fit < self.max_num_seqs:
            log.warning(
                "kvoffload_request_kv_budget_short",
                key=f"kv_connector_extra_config.{BUDGET_KEY}",
                budget_gib=round(self.budget_bytes / GIB, 3),
                worst_case_gib=round(self.worst_case_bytes / GIB, 3),
                requests_of_max_model_len=fit,
                max_num_seqs=self.max_num_seqs,
                then="a request whose worst case does not fit waits in vLLM's queue until running ones finish",
            )
        log.info(
            "kvoffload_request_kv_budget",
            budget_bytes=self.budget_bytes,
            source=self.source,
            per_request_bytes=one,
            worst_case_bytes=self.worst_case_bytes,
        )


def budget_size(vllm_config: Any, store: StoreConnectorConfig, shared: SharedBuffers, group: KVGroup) -> BudgetSize:
    """The budget of this engine: the key's, or ``DEFAULT_FRACTION`` of what is available now."""
    if store.layerwise_request_kv_gb is not None:
        budget, source = int(store.layerwise_request_kv_gb * GIB), f"kv_connector_extra_config.{BUDGET_KEY}"
    else:
        avail = available_bytes()
        budget = int(avail * DEFAULT_FRACTION)
        source = f"default: {DEFAULT_FRACTION:.0%} of the {avail / GIB:.3g} GiB available at start-up"
    return BudgetSize(
        budget,
        source,
        shared_layers=len(shared.previous_occupant),
        row_bytes=row_bytes(group, len(shared.layer_names)),
        ranks=vllm_config.parallel_config.tensor_parallel_size,
        block_size=group.block_size,
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
    )


def row_bytes(group: KVGroup, num_layers: int) -> int:
    """A layer's block in a host copy (``SharedSteps``' row): the pages of its caches side by side,
    the widest layer's."""
    per_layer: dict[int, int] = {}
    for name, spec in zip(group.layer_names, group.specs, strict=True):
        i = physical_index(name, num_layers)
        per_layer[i] = per_layer.get(i, 0) + spec.page_size_bytes
    return max(per_layer.values())


@dataclass(frozen=True)
class HostCopies:
    """What a step tells each worker of the copies: its share of the budget, and the requests vLLM
    finished since the last step (their copies are dropped before the step reserves)."""

    budget_bytes: int
    finished: tuple[str, ...] = ()


class HostCopyAdmission:
    """The scheduler's account of the copies: each admitted request's ceiling, in blocks."""

    def __init__(self, size: BudgetSize) -> None:
        self.size = size
        self._held: dict[str, int] = {}  # request id -> its ceiling (blocks)
        self._waiting: dict[str, None] = {}  # requests told to wait, in order
        self._finished: list[str] = []  # released since the last step's metadata

    def ceiling(self, request: Any) -> int:
        max_tokens = request.max_tokens if request.max_tokens is not None else self.size.max_model_len
        return self.size.blocks(request.num_prompt_tokens + max_tokens)

    def held_bytes(self) -> int:
        return sum(self._held.values()) * self.size.block_bytes

    def admit(self, request: Any) -> bool:
        """True when ``request`` holds its room or may take it now (``hold`` once vLLM allocated it);
        False: it waits (logged once)."""
        rid = request.request_id
        if rid in self._held:
            return True
        need = self.ceiling(request) * self.size.block_bytes
        if next(iter(self._waiting), rid) == rid and self.held_bytes() + need <= self.size.budget_bytes:
            return True
        if rid not in self._waiting:
            self._waiting[rid] = None
            log.info(
                "kvoffload_request_kv_wait",
                request_id=rid,
                need_bytes=need,
                held_bytes=self.held_bytes(),
                budget_bytes=self.size.budget_bytes,
                running=len(self._held),
                key=f"kv_connector_extra_config.{BUDGET_KEY}",
            )
        return False

    def hold(self, request: Any) -> None:
        self._waiting.pop(request.request_id, None)
        self._held.setdefault(request.request_id, self.ceiling(request))

    def max_blocks(self, request_id: str) -> int | None:
        return self._held.get(request_id)

    def release(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        if self._held.pop(request_id, None) is not None:
            self._finished.append(request_id)

    def take_step(self) -> HostCopies:
        """This step's ``HostCopies`` (each rank's share of the budget)."""
        finished, self._finished = tuple(self._finished), []
        return HostCopies(self.size.budget_bytes // self.size.ranks, finished)


def admission_of(
    vllm_config: Any, store: StoreConnectorConfig, shared: SharedBuffers | None, groups: tuple[KVGroup, ...]
) -> HostCopyAdmission | None:
    """The scheduler's admission with shared layer buffers (checked at start-up), else None."""
    if shared is None:
        return None
    size = budget_size(vllm_config, store, shared, groups[0])
    size.check()
    return HostCopyAdmission(size)
