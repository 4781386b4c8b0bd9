"""The demo's questions, with the document that answers each. Several hit the same document, so the
later ones find its KV cache already computed (on the engine the router picks for it)."""

from __future__ import annotations

QUESTIONS: list[tuple[str, str]] = [
    ("How often should I descale the Aurora X2 espresso machine, and can I use vinegar?", "aurora-x2-espresso"),
    ("A drive in my Nimbus NAS-4 failed. How do I replace it without losing data?", "nimbus-nas4"),
    ("What brew temperature does the Aurora X2 use by default, and what range can I set?", "aurora-x2-espresso"),
    ("How far can I ride the Tern Volt e-bike on one charge in ECO mode?", "tern-volt-ebike"),
    ("Which routing policies does the ragserve router offer?", "ragserve-router"),
    ("What does error code E07 mean on the Nimbus NAS-4 storage server?", "nimbus-nas4"),
    ("What does the Kestrel K2 drone do when its battery reaches 10 percent?", "kestrel-k2-drone"),
    ("How does the ragserve router decide which engine gets a request with kv_aware?", "ragserve-router"),
    ("How long is the warranty on the Aurora X2 boilers and pump?", "aurora-x2-espresso"),
    ("During a grid outage, which circuits does the Helio 6000 inverter keep powered?", "helio-6000-inverter"),
    ("What is the maximum wind speed the Kestrel K2 can handle?", "kestrel-k2-drone"),
    ("How is a stored block protected against corruption in the ragserve cachestore?", "ragserve-cachestore"),
]
