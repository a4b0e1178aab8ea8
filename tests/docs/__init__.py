"""The docs and benches stay true: names, links, README commands, dashboards, boundaries, bench figures."""
