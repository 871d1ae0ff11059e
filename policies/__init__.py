"""Routing policies: pure functions of a request, the workers' views and the index's matches.

No I/O and no clock: time arrives in the request (``RouteRequest.now``),
so the same code routes live traffic and the offline simulator.
"""
