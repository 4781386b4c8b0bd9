"""A request's priority class and tenant, as both front ends read them.

Class: X-Ragserve-Priority, an integer as a Gateway API InferenceObjective's priority (above 0 critical, 0
standard, below 0 sheddable); without the header, the body's OpenAI `service_tier` ("priority": critical,
"flex": sheddable, anything else standard). The body's `priority` is vLLM's scheduling priority (lower first) and
goes to the engine as it is; with --engine-priority a body without one gets the class's (critical -1, sheddable 1),
so that an engine run with --scheduling-policy priority schedules a critical request before the standard ones
waiting in it; with --tenant-fair-share as well, a standard request's is its rank (the places its tenant held when
it was admitted: 0, 1, ..., never below a rank it still holds) and a sheddable one's SHEDDABLE_FLOOR + its rank, so
the engine preempts the newest place of the tenant holding the most for a tenant under its share (flow.py), and
critical (-1) still goes first.
Tenant: the --tenant-header's value when set and present, else the API key's name, else the client address.
"""

from __future__ import annotations

from collections.abc import Mapping

from ragserve.http.errors import ApiError

PRIORITY_HEADER = "x-ragserve-priority"
CRITICAL, STANDARD, SHEDDABLE = "critical", "standard", "sheddable"
CLASSES = (CRITICAL, STANDARD, SHEDDABLE)  # in the order the router queue serves them
RANK = {cls: i for i, cls in enumerate(CLASSES)}
SERVICE_TIERS = {"priority": CRITICAL, "flex": SHEDDABLE}
ENGINE_PRIORITY = {CRITICAL: -1, SHEDDABLE: 1}  # vLLM's scheduling priority, lower first; standard keeps 0
SHEDDABLE_FLOOR = 1_000_000  # with ranks: above any standard request's (a rank is below the model's places)
MAX_TENANT = 128  # characters of a tenant name kept (a header value is the client's to choose)


def priority(headers: Mapping[str, str]) -> int | None:
    """X-Ragserve-Priority (None when absent); a value that is not an integer is a 400."""
    text = headers.get(PRIORITY_HEADER, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ApiError(400, f"{PRIORITY_HEADER} must be an integer, got {text[:32]!r}", "invalid_priority") from None


def traffic_class(headers: Mapping[str, str], body: dict) -> str:
    """critical, standard or sheddable (see the module's docstring)."""
    value = priority(headers)
    if value is not None:
        return CRITICAL if value > 0 else SHEDDABLE if value < 0 else STANDARD
    tier = body.get("service_tier")
    return SERVICE_TIERS.get(tier, STANDARD) if isinstance(tier, str) else STANDARD


def with_engine_priority(body: dict, cls: str, rank: int | None = None) -> dict | None:
    """The body with the class's scheduling priority (ranked within the class when `rank` is given); None when it
    keeps its own or the priority is standard's 0."""
    if "priority" in body:
        return None
    if rank is None or cls == CRITICAL:
        value = ENGINE_PRIORITY.get(cls, 0)
    else:
        value = rank + (SHEDDABLE_FLOOR if cls == SHEDDABLE else 0)
    return {**body, "priority": value} if value else None


def tenant_of(headers: Mapping[str, str], tenant_header: str, key_name: str | None, client: str) -> str:
    """Who a request's quota and fair share are counted for."""
    if tenant_header and (named := headers.get(tenant_header.lower(), "").strip()):
        return named[:MAX_TENANT]
    return key_name or client
