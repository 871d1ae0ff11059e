"""kvrouter: the gateway, the CLI and the benchmark harness."""

__version__ = "0.1.0"
