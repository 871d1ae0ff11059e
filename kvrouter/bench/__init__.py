"""Benchmarks. Every figure is a ratio measured side by side in one run (ours against a baseline).

``python -m kvrouter.bench.micro`` runs the micro benchmarks of the block
keys and the block pool (``make bench``).
"""
