"""Whole-system behaviour with real processes: faults, load, security, the demo, ports, the end-to-end checks."""
