"""Operations: Grafana dashboards, Prometheus alert rules and the ``kvrouter top`` view.

The dashboards and rules are Python data (:mod:`kvrouter.ops.dashboards`,
:mod:`kvrouter.ops.alerts`) rendered into the Helm chart by
``python -m kvrouter.ops.generate``; the tests check every PromQL
expression against a real scrape of a running cluster.
"""
