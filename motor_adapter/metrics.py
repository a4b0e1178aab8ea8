"""The adapter's metric types on ``prometheus-client``: what the service's modules register.

``prometheus-client`` keeps the counters and writes the text exposition (format 0.0.4);
this module keeps the project's calling convention, where a series' labels are given as
keywords at the first count (``counter.inc(path="/query", status=200)``) rather than
declared up front: a metric's label names are fixed by its first use, sorted by name.

- :class:`Counter` wraps the library's own type; :class:`Histogram` counts its buckets here
  and hands them to the library as a custom collector's family.  A hot path resolves a
  series once (:meth:`Counter.cell`: the library's child; :meth:`Histogram.series`) and
  counts on it with no label handling per count.
- :class:`Gauge` holds figures set at scrape time (stream health, rank loads, the registry):
  a custom collector's family, typed as a counter when the figure is one (``kind``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Union

import prometheus_client
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["Counter", "Gauge", "Histogram", "HistogramSeries", "Labels", "Registry", "LATENCY_BUCKETS_S"]

# The exposition keeps the series it always had: no ``*_created`` sample beside each counter
# and histogram (process-wide, as the library offers it; the adapter's process is its own).
prometheus_client.disable_created_metrics()

LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 3.0)
Labels = tuple[tuple[str, str], ...]  # (name, value) pairs sorted by name, values as strings
Adds = tuple[tuple[Any, float], ...]  # (a Counter.cell, the amount added to it) pairs
_REPEATS_MAX = 4096  # distinct Counter.repeat adds pending before they are folded in unread


def _key(labels: dict[str, object] | None) -> Labels:
    return tuple((k, str(v)) for k, v in sorted((labels or {}).items()))


class _Wrapped:
    """A library metric made at the first use, when its label names are known."""

    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self._metric: Any = None
        self._names: tuple[str, ...] = ()
        self._children: dict[Labels, Any] = {}

    def _make(self, names: tuple[str, ...]) -> Any:
        raise NotImplementedError

    def _child(self, labels: Labels) -> Any:
        found = self._children.get(labels)
        if found is not None:
            return found
        names = tuple(k for k, _ in labels)
        if self._metric is None:
            self._metric, self._names = self._make(names), names
        elif names != self._names:
            raise ValueError(f"{self.name}: labels {names} where its first use gave {self._names}")
        found = self._metric.labels(*(v for _, v in labels)) if names else self._metric
        self._children[labels] = found
        return found

    def _empty(self) -> Metric:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        if self._metric is None:
            yield self._empty()  # its HELP and TYPE before its first series, as any metric
        else:
            yield from self._metric.collect()

    def _samples(self, suffix: str) -> dict[Labels, float]:
        out: dict[Labels, float] = {}
        for family in self.collect():
            for sample in family.samples:
                if sample.name == family.name + suffix:
                    out[tuple(sorted(sample.labels.items()))] = sample.value
        return out


class Counter(_Wrapped):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"{name}: a counter's name ends in _total (the library would append it)")
        super().__init__(name, help_text)
        self._repeats: dict[int, tuple[Adds, list[int]]] = {}  # id(adds) -> (adds, [times]): see repeat()
        self._before_read: list[Callable[[], None]] = []

    def _make(self, names: tuple[str, ...]) -> Any:
        return prometheus_client.Counter(self.name, self.help, names, registry=None)

    def _empty(self) -> Metric:
        return CounterMetricFamily(self.name, self.help, labels=())

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        self._child(_key(labels)).inc(amount)

    def inc_labels(self, labels: Labels, amount: float = 1.0) -> None:
        """Hot-path ``inc``: ``labels`` already sorted by name, values already strings."""
        self._child(labels).inc(amount)

    def cell(self, labels: Labels) -> Any:
        """The series' counter (``labels`` as for ``inc_labels``; created with none): a caller
        that keeps it counts with ``cell.inc(n)``, no label handling per count."""
        return self._child(labels)

    def repeat(self, adds: Adds) -> None:
        """Adds ``adds`` (amounts to this counter's cells) once more, folded into the cells
        before the next read: a hot path that adds the same amounts to many series again and
        again (a repeated ``/query``'s hits per instance) pays one probe, not one add per
        series.  Integer amounts sum exactly as when added one by one."""
        entry = self._repeats.get(id(adds))  # the entry holds adds: its id is not reused meanwhile
        if entry is not None:
            entry[1][0] += 1
            return
        if len(self._repeats) >= _REPEATS_MAX:
            self._fold()
        self._repeats[id(adds)] = (adds, [1])

    def fold_before_read(self, fold: Callable[[], None]) -> None:
        """Calls ``fold`` before every read: a hot path that keeps its own counts (adds made
        later, :class:`motor_adapter.rank_render.AnswerTally`) adds them to the series then."""
        self._before_read.append(fold)

    def _fold(self) -> None:
        repeats, self._repeats = self._repeats, {}
        for adds, times in repeats.values():
            for cell, amount in adds:
                cell.inc(amount * times[0])

    def collect(self) -> Iterator[Metric]:
        for fold in self._before_read:
            fold()
        if self._repeats:
            self._fold()
        yield from super().collect()

    def items(self) -> dict[Labels, float]:
        """Every series and its value."""
        return self._samples("_total")

    def value(self, **labels: object) -> float:
        return self.items().get(_key(labels), 0.0)


class HistogramSeries:
    """One histogram series' counts (the bucket an observation falls in, the sum), counted
    on the event loop's thread as every hot-path series is and read when scraped."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a bucket holds values <= its bound
        self.sum += value


class Histogram:
    """Counted here (:class:`HistogramSeries`: a bisect and two adds), written by the library
    as a custom collector's histogram family: the library's own histogram takes a lock for
    the bucket and one for the sum on every observation, on ``/query``'s hot path
    (docs/perf/query-cpu.md)."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.name = name
        self.help = help_text
        self.buckets = tuple(sorted(buckets))
        self._le = [*(floatToGoString(b) for b in self.buckets), "+Inf"]
        self._names: Union[tuple[str, ...], None] = None
        self._series: dict[Labels, HistogramSeries] = {}

    def observe(self, value: float, **labels: object) -> None:
        self.series(_key(labels)).observe(value)

    def observe_labels(self, value: float, labels: Labels) -> None:
        self.series(labels).observe(value)

    def series(self, labels: Labels) -> HistogramSeries:
        """The series (``labels`` as for ``Counter.inc_labels``; created with none): a caller
        that keeps it observes with ``series.observe(value)``, as :meth:`Counter.cell`."""
        found = self._series.get(labels)
        if found is None:
            names = tuple(k for k, _ in labels)
            if self._names is None:
                self._names = names
            elif names != self._names:
                raise ValueError(f"{self.name}: labels {names} where its first use gave {self._names}")
            found = self._series[labels] = HistogramSeries(self.buckets)
        return found

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.help, labels=self._names or ())
        for labels, series in self._series.items():
            total, buckets = 0, []
            for le, count in zip(self._le, series.counts, strict=True):
                total += count
                buckets.append((le, float(total)))
            family.add_metric([v for _, v in labels], buckets, sum_value=series.sum)
        yield family

    def count(self, **labels: object) -> int:
        found = self._series.get(_key(labels))
        return sum(found.counts) if found is not None else 0


class Gauge:
    """Figures set at scrape time (``set``), exported as a gauge, or as a counter when
    ``kind`` says the figure is one (a total the stream or the engine keeps)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self._values: dict[Labels, float] = {}

    def set(self, value: float, **labels: object) -> None:
        self._values[_key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        key = _key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def clear(self) -> None:
        self._values.clear()

    def items(self) -> dict[Labels, float]:
        return dict(self._values)

    def value(self, **labels: object) -> float:
        return self._values.get(_key(labels), 0.0)

    def collect(self) -> Iterator[Metric]:
        family: Union[CounterMetricFamily, GaugeMetricFamily]
        names = sorted({k for labels in self._values for k, _ in labels})
        if self.kind == "counter":
            family = CounterMetricFamily(self.name, self.help, labels=names)
        else:
            family = GaugeMetricFamily(self.name, self.help, labels=names)
        for labels, value in sorted(self._values.items()):
            given = dict(labels)
            family.add_metric([given.get(k, "") for k in names], value)
        yield family


_Metric = Union[Counter, Histogram, Gauge]


class Registry:
    """The metrics of one part of the service, in the order they were added."""

    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self._metrics.append(metric)
        return metric

    def counter(self, name: str, help_text: str) -> Counter:
        metric = Counter(name, help_text)
        self._metrics.append(metric)
        return metric

    def gauge(self, name: str, help_text: str) -> Gauge:
        metric = Gauge(name, help_text)
        self._metrics.append(metric)
        return metric

    def histogram(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS_S) -> Histogram:
        metric = Histogram(name, help_text, buckets)
        self._metrics.append(metric)
        return metric

    def render(self, extra: Iterable[_Metric] = ()) -> str:
        """The text exposition of these metrics and ``extra`` (figures read at scrape time)."""
        return generate_latest(_Collect([*self._metrics, *extra])).decode()


class _Collect(Collector):
    """The library's collector protocol over a list of metrics."""

    def __init__(self, metrics: Sequence[_Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield from metric.collect()
