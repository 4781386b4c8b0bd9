"""kopf handlers: reconcile RAGServes on create / update / resume and whenever one of their children
changes or disappears (drift repair), and run one autoscaler loop per RAGServe."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from ragserve_operator import metrics
from ragserve_operator.apply import Emit
from ragserve_operator.kube import Kube, load_config
from ragserve_operator.names import MANAGED_BY, MANAGED_BY_LABEL, owner_of
from ragserve_operator.reconcile import reconcile
from ragserve_operator.scaling.autoscale_pass import autoscale_once, interval_of
from ragserve_operator.scaling.decision import Stabilizer
from ragserve_operator.spec import GROUP, PLURAL, POOL_PLURAL, VERSION

CHILD_RESOURCES = [
    (GROUP, VERSION, POOL_PLURAL),
    ("apps", "v1", "deployments"),
    ("apps", "v1", "statefulsets"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
]
MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
RESYNC_S = 60.0
log = logging.getLogger(__name__)


def emitter(body: Any) -> Emit:
    def emit(type_: str, reason: str, message: str) -> None:
        kopf.event(body, type=type_, reason=reason, message=message[:1024])

    return emit


RETRY_DELAY_S = 15.0  # `kopf run -m ragserve_operator.handlers`; `ragserve operator --retry-delay` sets memo's


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.INFO
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    if getattr(memo, "kube", None) is None:  # `kopf run -m ragserve_operator.handlers`
        memo.kube = Kube(load_config())


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile_ragserve(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    status = reconcile(memo.kube, namespace, name, emitter)
    reasons = {c["type"]: c["reason"] for c in (status or {}).get("conditions", [])}
    if reasons.get("Degraded") == "ApplyFailed":  # the API refused something: retry later
        raise kopf.TemporaryError(status["message"], delay=getattr(memo, "retry_delay", RETRY_DELAY_S))


def reconcile_owner(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child changed (status, edit, deletion): reconcile the RAGServe that controls it."""
    owner = owner_of(dict(body))
    if owner is not None:
        reconcile(memo.kube, *owner, emitter)


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, labels=MANAGED, id=f"child-{_plural}")(reconcile_owner)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10)
async def autoscaler(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The autoscaler loop, plus a periodic resync (a missed event or a failed pass gets repaired)."""
    stabilizers: dict[str, Stabilizer] = {}
    loop = asyncio.get_running_loop()
    last_resync = loop.time()
    while not stopped:
        meta = body.get("metadata", {})
        try:
            await autoscale_once(memo.kube, dict(body), stabilizers, emitter(body))
            if loop.time() - last_resync >= RESYNC_S:
                last_resync = loop.time()
                await asyncio.to_thread(reconcile, memo.kube, meta["namespace"], meta["name"], emitter)
        except Exception:  # a failed pass must not end the loop: the next one retries
            metrics.autoscaler_failures.inc()
            log.exception("autoscaler pass for %s failed", meta.get("name"))
        await stopped.wait(interval_of(dict(body)))
