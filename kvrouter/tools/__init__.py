"""Micro-benchmarks of the lower packages: tools for their developers, not the product.

Each module measures one package's hot path side by side with a baseline and
prints one table (``--json PATH`` writes the same rows); all of them render
through :mod:`kvrouter.tools.table`. Run one as ``python -m kvrouter.tools.<name>``:

* ``micro``: block keys and the block pool (engine_worker, indexer.keys); ``make bench``.
* ``engine_bench``: scheduler step, torch runner and profile fit (engine_worker).
* ``index_bench``: the Redis index layouts, lookups and writes (indexer.index).
* ``ingest_bench``: the event ingester against a direct index write (indexer.ingest).
* ``gateway_bench``: the gateway's decision time per request (kvrouter.gateway).
* ``transfer_bench``: worker-to-worker KV pulls against a loopback socket copy.

The offline simulator, traces, workloads and reports are the product and live
in :mod:`kvrouter.bench` (``kvrouter bench sim|gen|suite|live``).
"""
