"""Health from probes, with thresholds: an engine turns unhealthy after --health-failure-threshold failed probes
in a row and healthy again after --health-success-threshold passed ones, so one lost probe does not take a
working engine out and one answer does not put a flapping engine back. A request that cannot connect to an
engine takes it out at once (pool.mark_failure); it then needs the passed probes to come back."""

from __future__ import annotations

from typing import Protocol


class Judged(Protocol):
    healthy: bool
    streak: int  # > 0: probes passed in a row, < 0: failed in a row


def judge(health: Judged, passed: bool, failures: int, successes: int) -> bool:
    """Count one probe; True when it changes the engine's health."""
    health.streak = max(health.streak, 0) + 1 if passed else min(health.streak, 0) - 1
    if passed and not health.healthy and health.streak >= successes:
        health.healthy = True
        return True
    if not passed and health.healthy and -health.streak >= failures:
        health.healthy = False
        return True
    return False
