"""kvrouter's index package: block keys, the event schema, the global KV index.

Nothing here imports torch or any other package of ours, so that the gateway,
the indexer service and the policies can use it without the engine.
"""
