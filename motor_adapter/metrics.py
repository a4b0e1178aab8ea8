"""A tiny Prometheus text exposition (format 0.0.4) without a client library.

Counters, gauges and histograms with labels; single-threaded use from the service's event
loop (the stream figures are read from the subscribers' health snapshots at scrape time).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

__all__ = ["Counter", "Gauge", "Histogram", "Labels", "Registry", "LATENCY_BUCKETS_S"]

LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 3.0)
Labels = tuple[tuple[str, str], ...]
Adds = tuple[tuple[list[float], float], ...]  # (a Counter.cell, the amount added to it) pairs
_REPEATS_MAX = 4096  # distinct Counter.repeat adds pending before they are folded in unread


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _key(labels: dict[str, object] | None) -> Labels:
    return tuple((k, str(v)) for k, v in sorted((labels or {}).items()))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        super().__init__(name, help_text)
        self._values: dict[Labels, float] = {}
        self._cells: dict[Labels, list[float]] = {}  # series counted through cell()
        self._repeats: dict[int, tuple[Adds, list[int]]] = {}  # id(adds) -> (adds, [times]): see repeat()

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        key = _key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount

    def inc_labels(self, labels: Labels, amount: float = 1.0) -> None:
        """Hot-path ``inc``: ``labels`` already sorted by name, values already strings."""
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def cell(self, labels: Labels) -> list[float]:
        """The live one-item total of a series (``labels`` as for ``inc_labels``): a caller that
        keeps it counts with ``cell[0] += n``, no label hashing per count. Creates the series."""
        found = self._cells.get(labels)
        if found is None:
            found = self._cells[labels] = [self._values.pop(labels, 0.0)]
        return found

    def repeat(self, adds: Adds) -> None:
        """Adds ``adds`` (amounts to this counter's cells) once more, folded into the cells
        before the next read: a hot path that adds the same amounts to many series again and
        again (a repeated ``/query``'s hits per instance) pays one probe, not one add per
        series. Integer amounts sum exactly as when added one by one."""
        entry = self._repeats.get(id(adds))  # the entry holds adds: its id is not reused meanwhile
        if entry is not None:
            entry[1][0] += 1
            return
        if len(self._repeats) >= _REPEATS_MAX:
            self._fold()
        self._repeats[id(adds)] = (adds, [1])

    def _fold(self) -> None:
        for adds, times in self._repeats.values():
            for cell, amount in adds:
                cell[0] += amount * times[0]
        self._repeats.clear()

    def items(self) -> dict[Labels, float]:
        """Every series and its value."""
        if self._repeats:
            self._fold()
        out = dict(self._values)
        for labels, cell in self._cells.items():
            out[labels] = out.get(labels, 0.0) + cell[0]
        return out

    def value(self, **labels: object) -> float:
        if self._repeats:
            self._fold()
        key = _key(labels)
        cell = self._cells.get(key)
        return self._values.get(key, 0.0) + (cell[0] if cell is not None else 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(k)} {_number(v)}" for k, v in sorted(self.items().items())]


class Gauge(Counter):
    """A value set at scrape time (``set``) or counted up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        key = _key(labels)
        self._values[key] = value
        self._cells.pop(key, None)

    def clear(self) -> None:
        self._values.clear()
        self._cells.clear()


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        # per series: count per bucket (not cumulative; the last one is +Inf), then the sum
        self._series: dict[Labels, list[float]] = {}

    def observe(self, value: float, **labels: object) -> None:
        self.observe_labels(value, _key(labels))

    def observe_labels(self, value: float, labels: Labels) -> None:
        series = self.series(labels)
        series[bisect.bisect_left(self.buckets, value)] += 1
        series[-1] += value

    def series(self, labels: Labels) -> list[float]:
        """The live counts of a series (``labels`` as for ``Counter.inc_labels``; created with
        none): one count per bucket of :attr:`buckets` (not cumulative), then +Inf's, then the
        sum.  A caller that keeps it observes ``value`` with
        ``series[bisect_left(buckets, value)] += 1; series[-1] += value``: no label hashing
        per observation, as :meth:`Counter.cell`."""
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [0.0] * (len(self.buckets) + 2)
        return series

    def count(self, **labels: object) -> int:
        series = self._series.get(_key(labels))
        return int(sum(series[:-1])) if series else 0

    def lines(self) -> list[str]:
        out: list[str] = []
        for key, series in sorted(self._series.items()):
            total = 0.0
            for bound, count in zip(self.buckets, series, strict=False):
                total += count
                out.append(f"{self.name}_bucket{_labels(key, (('le', _number(bound)),))} {_number(total)}")
            count_all = sum(series[:-1])
            out.append(f"{self.name}_bucket{_labels(key, (('le', '+Inf'),))} {_number(count_all)}")
            out.append(f"{self.name}_count{_labels(key)} {_number(count_all)}")
            out.append(f"{self.name}_sum{_labels(key)} {_number(series[-1])}")
        return out


class Registry:
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
        lines: list[str] = []
        for metric in [*self._metrics, *extra]:
            lines += metric.header()
            lines += metric.lines()
        return "\n".join(lines) + "\n"
