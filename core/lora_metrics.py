"""The core's series by LoRA adapter (docs/lora.md, "Metrics"): requests running and waiting
and tokens served, each by tenant and adapter, and --max-loras. The tenant label puts them
under /metrics' tenant rules (a tenant's key reads its own); labels are bounded: the first
MAX_ADAPTER_LABELS adapter names seen have their own, the rest are "other". The info gauge
inference gateways read (vLLM's lora_requests_info shape) is made from these at each scrape
(common/metrics.py), so its changing labels never pile up."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from gapless.common.metrics import (
    LORA_MAX_ADAPTERS,
    LORA_REQUESTS_RUNNING,
    LORA_REQUESTS_WAITING,
    OTHER_TENANTS,
)

if TYPE_CHECKING:
    from gapless.core.scheduler import Scheduler

MAX_ADAPTER_LABELS = 64

Key = tuple[str, str]  # (tenant label, adapter label)


class LoraMetrics:
    def __init__(
        self, registry: CollectorRegistry | None, max_loras: int, tenant_label: Callable[[str], str]
    ) -> None:
        r = registry
        self.running = Gauge(
            LORA_REQUESTS_RUNNING, "Requests holding a seat, by tenant and LoRA adapter",
            ["tenant", "adapter"], multiprocess_mode="livesum", registry=r,
        )  # fmt: skip
        self.waiting = Gauge(
            LORA_REQUESTS_WAITING,
            "Requests waiting for a seat (or for their adapter to be read), by tenant and adapter",
            ["tenant", "adapter"], multiprocess_mode="livesum", registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "gapless_lora_tokens",
            "Tokens of ended requests by tenant and adapter: prompt tokens computed, outputs",
            ["tenant", "adapter", "kind"], registry=r,
        )  # fmt: skip
        self.max_loras = Gauge(
            LORA_MAX_ADAPTERS, "LoRA adapters one step may mix (--max-loras)",
            multiprocess_mode="livemax", registry=r,
        )  # fmt: skip
        self.max_loras.set(max_loras)
        self.tenant_label = tenant_label
        self._labels: dict[str, str] = {}
        self._shown: set[Key] = set()  # label pairs set above zero last time

    def adapter_label(self, name: str) -> str:
        label = self._labels.get(name)
        if label is None:
            if len(self._labels) >= MAX_ADAPTER_LABELS:
                return OTHER_TENANTS
            label = self._labels[name] = name
        return label

    def _key(self, tenant: str, adapter: str) -> Key:
        return self.tenant_label(tenant), self.adapter_label(adapter)

    def observe(self, scheduler: Scheduler) -> None:
        """Running and waiting requests of adapters now; tokens of those that ended since."""
        running, waiting = Tally(), Tally()
        for req in scheduler.running:
            if req.lora:
                running[self._key(req.tenant, req.lora)] += 1
        for req in scheduler.waiting_requests():
            if req.lora:
                waiting[self._key(req.tenant, req.lora)] += 1
        for key in self._shown | running.keys() | waiting.keys():
            self.running.labels(*key).set(running[key])
            self.waiting.labels(*key).set(waiting[key])
        self._shown = {k for k in running.keys() | waiting.keys()}
        seats = scheduler.lora
        if seats is not None and seats.ended:
            for tenant, adapter, prompt, outputs in seats.ended:
                key = self._key(tenant, adapter)
                self.tokens.labels(*key, "prompt").inc(prompt)
                self.tokens.labels(*key, "output").inc(outputs)
            seats.ended.clear()
