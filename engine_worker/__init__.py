"""The inference worker: block pool and tiers, scheduler, runners, server, event publisher.

Only the torch runner's modules import torch (``tiers``, ``sampling``,
``runners.torch_runner`` and the tensor modules of ``model``); they come with
the ``worker`` extra (``pip install 'kvrouter[worker]'``). Everything else --
the server, the scheduler, the sim runner, and the pieces the gateway shares
(``protocol``, ``tokenizer``, ``chat_template``, ``http_errors``,
``http_limits``) -- imports and runs without it.
"""
