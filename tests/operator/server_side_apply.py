"""Server-side apply and field ownership as the API server does them (structured-merge-diff), for the
in-memory API in conftest.py. No PyPI package implements it in Python, so this is a small one:

- every write records which manager owns which fields in metadata.managedFields (FieldsV1: "f:<key>" for
  a map key, 'k:{"name":"x"}' for an item of a keyed list, "." for a node that is itself owned);
- an Update (POST, PUT, merge / JSON patch, /scale) gives its manager the fields it changed;
- an Apply merges the configuration in (maps per key, keyed lists per item, other lists whole), conflicts
  with fields another manager set to another value (409, unless force, which takes them over), and
  removes the fields the manager applied before and leaves out now, unless another manager owns them.

Simplifications: which lists are keyed, and by what, comes from the field name (the Kubernetes types' merge
keys for the fields the operator writes); every other list is atomic; no schema defaulting.
"""

from __future__ import annotations

import copy
import json
from typing import Any

Path = tuple[str, ...]
ITEM = object()  # the value recorded for a keyed list item itself (its fields are recorded separately)

LIST_KEYS = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
}
SERVER_METADATA = {"managedFields", "resourceVersion", "uid", "generation", "creationTimestamp", "deletionTimestamp"}
SERVER_METADATA |= {"name", "namespace", "selfLink"}
UNTRACKED = {"apiVersion", "kind", "status"}


class Conflict(Exception):
    def __init__(self, conflicts: list[tuple[Path, str]], api_version: str) -> None:
        self.conflicts, self.api_version = conflicts, api_version
        super().__init__(f"Apply failed with {len(conflicts)} conflict{'s' * (len(conflicts) > 1)}")

    def status(self) -> dict:
        """The Status body the API server answers a conflicting apply with (409)."""
        causes = [
            {"type": "FieldManagerConflict", "message": f'conflict with "{m}" using {self.api_version}', "field": f}
            for f, m in ((dotted(p), m) for p, m in self.conflicts)
        ]
        message = f"{self}: " + "; ".join(f"{c['message']}: {c['field']}" for c in causes)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "Conflict",
            "code": 409,
            "message": message,
            "details": {"causes": causes},
        }


def dotted(path: Path) -> str:
    """('f:spec', 'f:replicas') -> '.spec.replicas', as the API server names conflicting fields."""
    return "".join(f".{p[2:]}" if p.startswith("f:") else f"[{p[2:]}]" for p in path)


def list_keys(field: str | None, items: list) -> tuple[str, ...] | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    if field == "ports":  # container ports and Service ports have different merge keys
        return ("containerPort", "protocol") if "containerPort" in items[0] else ("port", "protocol")
    return LIST_KEYS.get(field or "")


def item_key(item: dict, keys: tuple[str, ...]) -> str:
    return "k:" + json.dumps({k: item[k] for k in keys if k in item}, sort_keys=True, separators=(",", ":"))


def leaves(value: Any, path: Path = (), field: str | None = None) -> dict[Path, Any]:
    """The fields an object sets: path -> value (scalars, atomic lists, empty maps; ITEM for a list item)."""
    out: dict[Path, Any] = {}
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            if (not path and key in UNTRACKED) or (path == ("f:metadata",) and key in SERVER_METADATA):
                continue
            out.update(leaves(sub, (*path, f"f:{key}"), key))
    elif isinstance(value, list) and (keys := list_keys(field, value)):
        for item in value:
            item_path = (*path, item_key(item, keys))
            out[item_path] = ITEM
            out.update(leaves(item, item_path))
    elif path:
        out[path] = value
    return out


# managedFields <-> {(manager, operation): set of paths}


def to_fields_v1(paths: set[Path]) -> dict:
    tree: dict = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(part, {})
    for path in paths:
        node = tree
        for part in path:
            node = node[part]
        if node and "." not in node:
            node["."] = {}
    return tree


def from_fields_v1(tree: dict, path: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for part, sub in tree.items():
        if part == ".":
            out.add(path)
        elif sub:
            out |= from_fields_v1(sub, (*path, part))
        else:
            out.add((*path, part))
    return out


def owners_of(obj: dict | None) -> dict[tuple[str, str], set[Path]]:
    entries = ((obj or {}).get("metadata") or {}).get("managedFields") or []
    return {(e["manager"], e["operation"]): from_fields_v1(e.get("fieldsV1") or {}) for e in entries}


def with_owners(obj: dict, owners: dict[tuple[str, str], set[Path]]) -> dict:
    entries = [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": obj.get("apiVersion", ""),
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(paths),
        }
        for (manager, operation), paths in owners.items()
        if paths
    ]
    obj.setdefault("metadata", {})["managedFields"] = entries
    return obj


# writes


def update(old: dict | None, new: dict, manager: str) -> dict:
    """`new` with managedFields after an Update by `manager`: it owns the fields it changed or added."""
    owners = owners_of(old)
    before, after = leaves(old or {}), leaves(new)
    changed = {p for p, v in after.items() if p not in before or (v is not ITEM and before[p] != v)}
    gone = set(before) - set(after)
    owners = {key: paths - changed - gone for key, paths in owners.items()}
    owners[(manager, "Update")] = owners.get((manager, "Update"), set()) | changed
    return with_owners(new, owners)


def apply(live: dict | None, config: dict, manager: str, force: bool) -> dict:
    """The object after `manager` applies `config` to `live` (None: it does not exist yet). Raises Conflict."""
    owners = owners_of(live)
    mine = (manager, "Apply")
    applied, current = leaves(config), leaves(live or {})
    conflicts = [
        (path, other)
        for path, value in applied.items()
        if value is not ITEM and current.get(path, value) != value
        for (other, operation), paths in owners.items()
        if (other, operation) != mine and path in paths
    ]
    if conflicts and not force:
        raise Conflict(conflicts, config.get("apiVersion", ""))
    taken = {path for path, _ in conflicts}
    owners = {key: paths - taken for key, paths in owners.items()}
    merged = merge(copy.deepcopy(live or {}), config)
    others = set().union(*(paths for key, paths in owners.items() if key != mine))
    stale = owners.get(mine, set()) - set(applied)
    owners[mine] = set(applied)
    kept = others | owners[mine]
    for path in sorted(stale, key=len):
        if not any(other[: len(path)] == path for other in others):
            remove(merged, path, kept)
    return with_owners(merged, owners)


def merge(live: Any, config: Any, field: str | None = None) -> Any:
    if isinstance(live, dict) and isinstance(config, dict):
        for key, value in config.items():
            live[key] = merge(live[key], value, key) if key in live else copy.deepcopy(value)
        return live
    keys = list_keys(field, config) if isinstance(config, list) else None
    if keys and isinstance(live, list):
        by_key = {item_key(i, keys): i for i in live if isinstance(i, dict)}
        out = [merge(by_key.pop(item_key(i, keys)), i) if item_key(i, keys) in by_key else i for i in config]
        return copy.deepcopy(out) + list(by_key.values())  # the applied order, then items others added
    return copy.deepcopy(config)


def remove(obj: dict, path: Path, kept: set[Path]) -> None:
    """Delete the field at `path`, then the maps and lists left empty by it that no manager owns (`kept`)."""
    chain = [obj]
    for part in path[:-1]:
        node = _child(chain[-1], part)
        if node is None:
            return
        chain.append(node)
    _delete(chain[-1], path[-1])
    for depth in range(len(path) - 1, 0, -1):
        if chain[depth] in ({}, []) and path[:depth] not in kept:
            _delete(chain[depth - 1], path[depth - 1])


def _child(node: Any, part: str) -> Any:
    if part.startswith("f:") and isinstance(node, dict):
        return node.get(part[2:])
    if part.startswith("k:") and isinstance(node, list):
        want = json.loads(part[2:])
        return next((i for i in node if isinstance(i, dict) and all(i.get(k) == v for k, v in want.items())), None)
    return None


def _delete(node: Any, part: str) -> None:
    if isinstance(node, dict):
        node.pop(part[2:], None)
    elif isinstance(node, list) and (item := _child(node, part)) is not None:
        node.remove(item)
