"""Prometheus text (``GET /metrics``) as checks, benches and the demo's summary read it.

A sample asked for that the text does not have is an error naming it (``MissingMetric``), never a
0: a metric renamed or dropped by a server would otherwise read as "nothing held", "no failure",
"idle" and make the check that reads it pass without measuring anything. Names match exactly (a
sample ``x_total`` is not ``x_total_created``), and labels select: ``total(name, source="a")`` sums
the samples of ``name`` whose labels include ``source="a"``.

A labelled counter has no sample until its first increment (prometheus_client writes only its
``# TYPE`` line); ``declares`` tells such a metric (declared, no series yet: 0 is its true value)
from one the server does not export at all.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]

# the samples a metric family of each type writes besides its own name
_SUFFIXES = ("_total", "_created", "_count", "_sum", "_bucket", "_gcount", "_gsum", "_info")


class MissingMetric(LookupError):
    """A metric (or a labelled series of it) a reader needs is not in the text."""


@dataclass(frozen=True)
class Metrics:
    """One scrape: every sample, (name, sorted labels) -> value, and the declared family names."""

    samples: dict[tuple[str, Labels], float]
    families: frozenset[str]
    source: str = "/metrics"

    @classmethod
    def parse(cls, text: str, source: str = "/metrics") -> Metrics:
        from prometheus_client.parser import text_string_to_metric_families

        samples, families = {}, set()
        for family in text_string_to_metric_families(text):
            families.add(family.name)
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(samples, frozenset(families), source)

    def declares(self, name: str) -> bool:
        """Whether ``name`` (a sample name: ``x_total``, ``x_count``) belongs to a family the text
        declares, with or without samples."""
        if name in self.families or any(n == name for n, _ in self.samples):
            return True
        return any(name.endswith(s) and name[: -len(s)] in self.families for s in _SUFFIXES)

    def values(self, name: str, **labels: str) -> list[float]:
        """The values of the samples named ``name`` whose labels include ``labels`` (one per
        series); raises ``MissingMetric`` when there is none."""
        want = set(labels.items())
        got = [v for (n, ls), v in self.samples.items() if n == name and want <= set(ls)]
        if not got:
            raise MissingMetric(self._missing(name, labels))
        return got

    def label_sets(self, name: str) -> list[dict[str, str]]:
        """The labels of every sample named ``name`` (an ``_info`` gauge carries its data there);
        raises ``MissingMetric`` when there is none."""
        got = [dict(ls) for n, ls in self.samples if n == name]
        if not got:
            raise MissingMetric(self._missing(name, {}))
        return got

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``values(name, **labels)``: a metric with no such sample raises."""
        return sum(self.values(name, **labels))

    def _missing(self, name: str, labels: dict[str, str]) -> str:
        series = [dict(ls) for n, ls in self.samples if n == name]
        if series:
            return (
                f"{self.source}: no sample {name}{_fmt(labels)}; its series: "
                f"{', '.join(name + _fmt(s) for s in series[:10])}"
            )
        near = sorted({n for n, _ in self.samples if n.split("_")[:2] == name.split("_")[:2]})[:10]
        return (
            f"{self.source}: no sample named {name!r}"
            + (" (declared, but no series yet)" if self.declares(name) else "")
            + (f"; samples with a like name: {', '.join(near)}" if near else "")
        )


def _fmt(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def scrape(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> Metrics:
    """``GET {url}/metrics``, parsed."""
    req = urllib.request.Request(f"{url}/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return Metrics.parse(resp.read().decode(), source=f"{url}/metrics")


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of sample ``name`` (with ``labels``) on ``url``'s /metrics; ``MissingMetric`` when absent."""
    return scrape(url).total(name, **labels)
