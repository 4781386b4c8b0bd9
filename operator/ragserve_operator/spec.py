"""The RAGServe spec: CRD schema defaults and validation (the same schema the API server enforces),
the cross-field rules the CRD states in CEL, and typed views of the result."""

from __future__ import annotations

import argparse
import copy
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from ragserve.flags import parse_bytes
from ragserve_operator.crd import crd

GROUP = "ragserve.dev"
VERSION = "v1alpha1"
PLURAL = "ragserves"
KIND = "RAGServe"
POOL_KIND = "RAGServeEnginePool"  # one per engine pool, owned by its RAGServe: what scaling tools target
POOL_PLURAL = "ragserveenginepools"
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 31  # children are named <name>-engine-<pool> (pool <= 24): DNS labels stay <= 63

# Mirrors of the CRD's x-kubernetes-validations (same messages; test_crd checks they match).
CROSS_FIELD_RULES: list[tuple[str, Any]] = [
    (
        "router.replicas > 1 needs shared state: set redis.mode to inCluster or external",
        lambda s: s["router"]["replicas"] <= 1 or s["redis"]["mode"] != "off",
    ),
    (
        "cachestore.redisTier needs a Redis: set redis.mode to inCluster or external",
        lambda s: not s["cachestore"]["redisTier"] or s["redis"]["mode"] != "off",
    ),
    (
        "router.tls.enabled needs router.tls.secretName",
        lambda s: not s["router"]["tls"]["enabled"] or bool(s["router"]["tls"].get("secretName")),
    ),
    (
        "router.httpTls.enabled needs router.httpTls.secretName",
        lambda s: not s["router"]["httpTls"]["enabled"] or bool(s["router"]["httpTls"].get("secretName")),
    ),
    (
        "router.tls.clientAuth needs router.tls.engineClientSecret",
        lambda s: not s["router"]["tls"]["clientAuth"] or bool(s["router"]["tls"].get("engineClientSecret")),
    ),
    (
        "cachestore.tls.enabled needs cachestore.tls.secretName",
        lambda s: not s["cachestore"]["tls"]["enabled"] or bool(s["cachestore"]["tls"].get("secretName")),
    ),
    (
        "cachestore.tls.clientAuth needs cachestore.tls.engineClientSecret",
        lambda s: not s["cachestore"]["tls"]["clientAuth"] or bool(s["cachestore"]["tls"].get("engineClientSecret")),
    ),
    (
        "runtime vllm pools need router.tokenizer.path (the model's tokenizer.json dir or .gguf, for the router's "
        "--tokenizer)",
        lambda s: not _vllm(s) or bool(s["router"]["tokenizer"].get("path")),
    ),
    (
        "runtime vllm pools need one vllm.blockSize (the router has one --external-block-size)",
        lambda s: len({p["vllm"]["blockSize"] for p in _vllm(s)}) <= 1,
    ),
    (
        "redis.mode external needs redis.url or redis.urlSecret",
        lambda s: s["redis"]["mode"] != "external" or "url" in s["redis"] or "urlSecret" in s["redis"],
    ),
    (
        "gateway.inferencePool: runtime vllm pools cannot be InferencePool members (the EPP may only pick members): "
        "serve them through the router's own API",
        lambda s: not _pool_on(s) or not _vllm(s),
    ),
    (
        "engines[].httpTls.clientAuth needs router.engineTls.clientSecret (the client certificate the router presents)",
        lambda s: (
            not any(_https(p)["clientAuth"] for p in s["engines"]) or bool(s["router"]["engineTls"].get("clientSecret"))
        ),
    ),
    (
        "engines[].httpTls: gateway.inferencePool sends the gateway's traffic to engine pods over plain HTTP",
        lambda s: not _pool_on(s) or not any(_https(p)["enabled"] for p in s["engines"]),
    ),
    (
        "gateway.inferencePool.tls.mode secret needs tls.secretName",
        lambda s: not _pool_on(s) or _pool(s)["tls"]["mode"] != "secret" or bool(_pool(s)["tls"].get("secretName")),
    ),
    (
        "gateway.inferencePool.httpRoute needs parentRefs (the Gateway to attach to)",
        lambda s: not _pool_on(s) or not _pool(s)["httpRoute"]["enabled"] or bool(_pool(s)["httpRoute"]["parentRefs"]),
    ),
]
POOL_RULES: list[tuple[str, Any]] = [
    ("minReplicas must be <= maxReplicas", lambda p: p["minReplicas"] <= p["maxReplicas"]),
    (
        "httpTls.enabled needs httpTls.secretName",
        lambda p: not _https(p)["enabled"] or bool(_https(p).get("secretName")),
    ),
    ("httpTls.clientAuth needs httpTls.enabled", lambda p: not _https(p)["clientAuth"] or _https(p)["enabled"]),
    (
        "httpTls is for runtime ragserve pools (a vllm pool: vLLM's --ssl-* flags in vllm.extraArgs)",
        lambda p: not _https(p)["enabled"] or p["runtime"] != "vllm",
    ),
    (
        "prefiller is for role decode pools (the prefill leg a decode engine runs on the prefill engine the endpoint "
        "picker names)",
        lambda p: "prefiller" not in p or p["role"] == "decode",
    ),
    (
        "runtime vllm needs gpus >= 1 (the vllm/vllm-openai image is CUDA)",
        lambda p: p["runtime"] != "vllm" or p["gpus"] >= 1,
    ),
]
MAX_STATEFULSET_NAME = 52  # its pods get a controller-revision-hash label <name>-<10 chars> (<= 63)


def _vllm(spec: dict) -> list[dict]:
    return [p for p in spec["engines"] if p["runtime"] == "vllm"]


def _https(pool: dict) -> dict:
    return pool["httpTls"]


def _pool(spec: dict) -> dict:
    return spec["gateway"]["inferencePool"]


def _pool_on(spec: dict) -> bool:
    return bool(_pool(spec)["enabled"])


class SpecError(ValueError):
    """An invalid RAGServe spec; the message says what to fix."""


def spec_schema() -> dict:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def apply_defaults(schema: dict, value: Any) -> Any:
    """Fill `default`s the way the API server does (nested defaults apply inside defaulted objects)."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(schema["items"], item)
    return value


def _path(error: jsonschema.ValidationError) -> str:
    out = "spec"
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def check_name(name: str) -> None:
    if len(name) > MAX_NAME or not NAME_RE.match(name):
        raise SpecError(
            f"metadata.name {name!r} must be a DNS-1035 label of at most {MAX_NAME} characters "
            "(it prefixes the names of the children)"
        )


def validated(raw: dict | None) -> dict:
    """Defaulted copy of a raw spec, or SpecError listing every problem."""
    spec = apply_defaults(spec_schema(), copy.deepcopy(dict(raw or {})))
    validator = jsonschema.Draft4Validator(spec_schema())
    problems = [f"{_path(e)}: {e.message}" for e in sorted(validator.iter_errors(spec), key=str)]
    if not problems:
        problems += [message for message, ok in CROSS_FIELD_RULES if not ok(spec)]
        for i, pool in enumerate(spec["engines"]):
            problems += [f"spec.engines[{i}]: {message}" for message, ok in POOL_RULES if not ok(pool)]
        names = [pool["name"] for pool in spec["engines"]]
        problems += [f"spec.engines: pool name {n!r} is used twice" for n in sorted(set(names)) if names.count(n) > 1]
        problems += _size_problems(spec)
    if problems:
        raise SpecError("; ".join(problems))
    return spec


def _size_problems(spec: dict) -> list[str]:
    cs = spec["cachestore"]
    sizes = [("spec.cachestore.memory", cs["memory"]), ("spec.cachestore.disk", cs["disk"])]
    for i, pool in enumerate(spec["engines"]):
        sizes.append((f"spec.engines[{i}].engine.kvCacheMemory", pool["engine"].get("kvCacheMemory")))
    out = []
    for where, text in sizes:
        try:
            if text:
                parse_bytes(text)
        except argparse.ArgumentTypeError as exc:
            out.append(f"{where}: {exc}")
    return out


@dataclass(frozen=True)
class Image:
    repository: str
    tag: str
    pull_policy: str

    def ref(self, default_tag: str) -> str:
        return f"{self.repository}:{self.tag or default_tag}"


def _image(raw: dict, fallback: Image | None = None) -> Image:
    base = fallback or Image("", "", "IfNotPresent")
    return Image(
        raw.get("repository", base.repository), raw.get("tag", base.tag), raw.get("pullPolicy", base.pull_policy)
    )


@dataclass(frozen=True)
class Pool:
    name: str
    model: str
    image: Image
    raw: dict = field(repr=False)  # the defaulted pool, for pass-through fields (resources, env, ...)

    @property
    def engine_flags(self) -> dict[str, Any]:
        return self.raw["engine"]


@dataclass(frozen=True)
class VllmPool:
    """A runtime: vllm pool: a StatefulSet of `replicas` vLLM pods (no RAGServeEnginePool: not autoscaled)."""

    name: str
    model: str
    image: Image
    replicas: int
    raw: dict = field(repr=False)

    @property
    def vllm(self) -> dict:
        return self.raw["vllm"]


@dataclass(frozen=True)
class RAGServeSpec:
    image: Image
    pools: list[Pool]  # runtime: ragserve pools (each with its RAGServeEnginePool)
    router: dict
    cachestore: dict
    redis: dict
    autoscaling: dict
    image_pull_secrets: list[dict]
    engine_api_key: dict | None = None  # {name, key} of a Secret
    vllm_pools: list[VllmPool] = field(default_factory=list)
    gateway: dict = field(default_factory=dict)  # spec.gateway, defaulted (inferencePool)


def parse_spec(raw: dict | None, name: str | None = None) -> RAGServeSpec:
    if name is not None:
        check_name(name)
    spec = validated(raw)
    if name is not None:
        _check_vllm_names(name, spec)
    engine_image = _image(spec["engineImage"])
    ragserve = [p for p in spec["engines"] if p["runtime"] == "ragserve"]
    pools = [Pool(p["name"], p["model"], _image(p.get("image", {}), engine_image), p) for p in ragserve]
    vllm = [VllmPool(p["name"], p["model"], _image(p["vllm"]["image"]), p["replicas"], p) for p in _vllm(spec)]
    return RAGServeSpec(
        image=_image(spec["image"]),
        pools=pools,
        router=spec["router"],
        cachestore=spec["cachestore"],
        redis=spec["redis"],
        autoscaling=spec["autoscaling"],
        image_pull_secrets=spec.get("imagePullSecrets", []),
        engine_api_key=spec.get("engineApiKeySecret"),
        vllm_pools=vllm,
        gateway=spec["gateway"],
    )


def _check_vllm_names(name: str, spec: dict) -> None:
    long = [p["name"] for p in _vllm(spec) if len(f"{name}-vllm-{p['name']}") > MAX_STATEFULSET_NAME]
    if long:
        raise SpecError(
            f"spec.engines: runtime vllm pools {', '.join(long)}: StatefulSet {name}-vllm-<pool> must be at most "
            f"{MAX_STATEFULSET_NAME} characters (shorten the pool or the RAGServe name)"
        )
