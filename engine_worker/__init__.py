"""The inference worker: block pool and tiers, scheduler, runners, server, event publisher.

Importing this package (and its ``tokenizer`` module) does not import
torch; modules that compute with tensors import it themselves.
"""
