"""The shipped alert rules (docs/alerts.yml) and Grafana dashboards (docs/grafana-*.json) query
only metrics a running adapter exports (its real ``/metrics``, the ``exported_metrics`` fixture),
and the rules load in Prometheus's own checker when it is installed (CI installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import metric_names

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "docs" / "alerts.yml"
DASHBOARDS = sorted((ROOT / "docs").glob("grafana-*.json"))
OURS = re.compile(r"\bmotor_kv_adapter_[a-zA-Z0-9_]+")

pytestmark = pytest.mark.integration


def alert_expressions() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def dashboard_expressions() -> dict[str, str]:
    found = {}
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text(encoding="utf-8"))["panels"]:
            for target in panel.get("targets", []):
                found[f"{path.name}: {panel['title']} ({target['refId']})"] = target["expr"]
    return found


def _unknown(expressions: dict[str, str], exported: set[str]) -> list[str]:
    problems = []
    for name, expr in expressions.items():
        used = set(OURS.findall(expr))
        if not used:
            problems.append(f"{name}: names no metric of the adapter")
        problems += [f"{name}: {metric} is not in the adapter's /metrics" for metric in sorted(used - exported)]
    return problems


def test_every_alert_names_metrics_the_adapter_exports(exported_metrics: str) -> None:
    expressions = alert_expressions()
    assert len(expressions) >= 10
    assert _unknown(expressions, metric_names(exported_metrics)) == []


def test_every_dashboard_query_names_metrics_the_adapter_exports(exported_metrics: str) -> None:
    expressions = dashboard_expressions()
    assert {p.name for p in DASHBOARDS} >= {"grafana-routing.json", "grafana-adapter-health.json"}
    assert _unknown(expressions, metric_names(exported_metrics)) == []


def test_the_alerts_cover_what_an_operator_must_hear_about() -> None:
    """Silent streams, gaps or replays rising, /query errors and p99, missed registrations and
    rank load skew each have a rule."""
    joined = "\n".join(alert_expressions().values())
    for metric in (
        "motor_kv_adapter_stream_connected",
        "motor_kv_adapter_stream_gaps_total",
        "motor_kv_adapter_stream_replays_total",
        "motor_kv_adapter_requests_total",
        "motor_kv_adapter_query_seconds_bucket",
        "motor_kv_adapter_unregistered_queries_total",
        "motor_kv_adapter_instance_rank_load_skew",
    ):
        assert metric in joined, f"no alert rule uses {metric}"


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian: apt-get install prometheus); .ci/run installs and runs it")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
