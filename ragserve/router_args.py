"""`ragserve router` settings, written once. Torch-free and importable without the router package, so
`ragserve up`, the operator and the chart tests read the same policy names and defaults.
"""

from __future__ import annotations

# The routing policies, in the order the router registers them (ragserve_router.policies keys its classes by these).
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "session", "prefix", "kv_aware")
DEFAULT_POLICY = "kv_aware"
