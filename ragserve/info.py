"""`ragserve info`: a model's metadata and cache identity, without loading weights."""

from __future__ import annotations

import argparse
import json

from ragserve.keys import KEY_SCHEME
from ragserve.model_source import DEFAULT_MODEL, model_fingerprint, model_metadata, resolve_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="alias, HF directory or .gguf file")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    source = resolve_model(args.model)
    info = {
        "model": source.name,
        "path": str(source.path),
        "format": source.kind,
        "model_id": model_fingerprint(source),
        "key_scheme": KEY_SCHEME,
        **model_metadata(source),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key:>24}: {value}")
    return 0
