"""The offline simulator and its benchmark product (``kvrouter bench sim|gen|suite|live``).

Traces and workloads feed the simulator, which replays them through the real
routing policies and scheduler cores; the oracle bounds what any policy could
reach, and the report turns runs into tables and plots. Every figure is a
ratio measured side by side in one run (ours against a baseline).

The micro-benchmarks of the lower packages (block pool, index, ingester,
gateway, transfer) are developer tools in :mod:`kvrouter.tools`.
"""
