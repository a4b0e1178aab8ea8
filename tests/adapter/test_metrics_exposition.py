"""The adapter's metric types on prometheus-client: the exposition keeps each series' name,
labels and type; label names are fixed by a metric's first use; repeated adds are folded in
before any read."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from motor_adapter import metrics

pytestmark = pytest.mark.unit


def _parsed(text: str) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]:
    out = {}
    for family in text_string_to_metric_families(text):
        out[family.name] = (family.type, {tuple(sorted(s.labels.items())): s.value for s in family.samples})
    return out


def test_the_exposition_keeps_names_labels_and_types() -> None:
    reg = metrics.Registry()
    requests = reg.counter("x_requests_total", "requests")
    latency = reg.histogram("x_query_seconds", "latency", buckets=(0.1, 1.0))
    reg.counter("x_unused_total", "never counted")
    requests.inc(path="/query", status=200)
    requests.inc(2, status=200, path="/query")
    latency.observe(0.05, model="m")
    latency.observe(2.0, model="m")
    scraped = metrics.Gauge("x_stream_gaps_total", "gaps")
    scraped.kind = "counter"
    scraped.set(3, stream="s", dp_rank="all")
    level = metrics.Gauge("x_connected", "live")
    level.set(1)
    text = reg.render([scraped, level])
    assert 'x_requests_total{path="/query",status="200"} 3.0' in text.splitlines()
    assert "# TYPE x_unused_total counter" in text  # declared before its first series
    assert "_created" not in text
    families = _parsed(text)
    assert families["x_requests"] == ("counter", {(("path", "/query"), ("status", "200")): 3.0})
    kind, samples = families["x_query_seconds"]
    assert kind == "histogram"
    assert samples[(("le", "0.1"), ("model", "m"))] == 1.0
    assert samples[(("le", "+Inf"), ("model", "m"))] == 2.0
    assert families["x_stream_gaps"] == ("counter", {(("dp_rank", "all"), ("stream", "s")): 3.0})
    assert families["x_connected"] == ("gauge", {(): 1.0})
    assert latency.count(model="m") == 2 and requests.value(path="/query", status="200") == 3.0


def test_label_names_are_fixed_by_the_first_use() -> None:
    counter = metrics.Counter("x_writes_total", "writes")
    counter.inc(op="put", result="ok")
    with pytest.raises(ValueError, match="first use"):
        counter.inc(op="put")
    with pytest.raises(ValueError, match="_total"):
        metrics.Counter("x_writes", "a counter named without _total")


def test_repeated_adds_are_folded_in_before_a_read() -> None:
    counter = metrics.Counter("x_hits_total", "hits")
    adds = ((counter.cell((("instance", "a"),)), 3), (counter.cell((("instance", "b"),)), 1))
    for _ in range(5):
        counter.repeat(adds)
    counter.cell((("instance", "a"),)).inc(2)
    assert counter.items() == {(("instance", "a"),): 17.0, (("instance", "b"),): 5.0}
    counter.repeat(adds)
    assert 'x_hits_total{instance="b"} 6.0' in metrics.Registry().render([counter])
