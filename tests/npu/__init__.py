"""NPU / GPU tier (real hardware); a package so its conftest does not shadow tests/conftest.py."""
