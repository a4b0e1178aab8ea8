"""The router side: the service and its /query answers, scoring, rendering, readiness, metrics, tokenization."""
