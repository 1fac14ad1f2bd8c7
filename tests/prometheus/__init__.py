"""The shipped Prometheus side: rules, Prometheus / Alertmanager configs, the Grafana dashboard's queries,
against Debian's real Prometheus tools. A package, so that its conftest.py is ``prometheus.conftest``
and leaves the ``conftest`` module the other tests import from (tests/conftest.py) alone."""
