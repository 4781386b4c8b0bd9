"""Blend tests through real processes: the router test fixtures (tests/router/conftest.py)."""

from tests.router.conftest import Cluster, Server, metrics, model_dir, module_cluster, until  # noqa: F401 (fixtures)
