"""Generate the values table in README.md from values.schema.json (descriptions, types) and values.yaml (defaults).

python charts/ragserve/scripts/gen_readme.py          # rewrite the table in README.md
python charts/ragserve/scripts/gen_readme.py --check  # exit 1 if README.md and the schema drifted
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from generated import write_or_check  # this folder's (scripts run by path)

START, END = "<!-- values-table:start -->", "<!-- values-table:end -->"
HEADER = "| Key | Type | Default | Description |\n|---|---|---|---|"


def resolve(schema: dict, node: dict) -> dict:
    """Follow local $refs and merge allOf parts; the referring node's description wins."""
    if "$ref" in node:
        target = schema
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return {**resolve(schema, target), **{k: v for k, v in node.items() if k == "description"}}
    if "allOf" in node:
        merged: dict = {"properties": {}, "required": []}
        for part in map(lambda p: resolve(schema, p), node["allOf"]):
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += part.get("required", [])
        return {**merged, **{k: v for k, v in node.items() if k != "allOf"}}
    return node


def type_of(node: dict) -> str:
    kinds = node.get("type", "object")
    text = " \\| ".join(kinds) if isinstance(kinds, list) else kinds
    if "enum" in node:
        text += ": " + ", ".join(f"`{v}`" for v in node["enum"])
    bounds = [
        f"{op} {node[k]}" for k, op in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤")) if k in node
    ]
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def default_of(values: object, path: list[str]) -> str:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return ""
        values = values[key]
    return f"`{json.dumps(values)}`".replace("|", "\\|")


def rows(schema: dict, node: dict, values: dict, path: list[str]) -> list[str]:
    node = resolve(schema, node)
    if node.get("properties"):
        props = [(k, child) for k, child in node["properties"].items() if child is not False]
        return [r for key, child in props for r in rows(schema, child, values, [*path, key])]
    description = node.get("description", "").replace("|", "\\|")
    out = [f"| `{'.'.join(path)}` | {type_of(node)} | {default_of(values, path)} | {description} |"]
    items = resolve(schema, node.get("items", {}))
    for key in items.get("required", []):
        child = resolve(schema, items["properties"][key])
        if "description" in child:
            out.append(f"| `{'.'.join(path)}[].{key}` | {type_of(child)} (required) | | {child['description']} |")
    return out


def table(chart: Path) -> str:
    schema = json.loads((chart / "values.schema.json").read_text())
    values = yaml.safe_load((chart / "values.yaml").read_text())
    return "\n".join([HEADER, *rows(schema, schema, values, [])])


def updated_readme(chart: Path) -> str:
    text = (chart / "README.md").read_text()
    head, found, rest = text.partition(START)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise SystemExit(f"{chart / 'README.md'} lacks the {START} ... {END} markers")
    return f"{head}{START}\n{table(chart)}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md's table is stale")
    parser.add_argument("--chart", type=Path, default=Path(__file__).resolve().parent.parent, help="chart directory")
    args = parser.parse_args()
    fix = f"values.schema.json or values.yaml changed; run {Path(__file__).name}"
    return write_or_check(args.chart / "README.md", updated_readme(args.chart), args.check, fix)


if __name__ == "__main__":
    sys.exit(main())
