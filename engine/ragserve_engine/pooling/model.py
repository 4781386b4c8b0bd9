"""PoolingModel: a Hugging Face encoder (BERT family) or decoder run through transformers' AutoModel (the torch
reference path), its last hidden states pooled to one vector per input (mean, CLS or last token), L2-normalized.

Pooling follows the directory's sentence-transformers config (1_Pooling/config.json, modules.json) when it has
one, else mean for encoders and last token for decoders (vLLM's defaults).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DECODER_SUFFIX = "ForCausalLM"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str  # mean | cls | last
    normalize: bool
    hidden_size: int
    max_model_len: int
    matryoshka: bool  # the model was trained so that a prefix of its vector is a good embedding (`dimensions`)
    is_decoder: bool


def _json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def pooler_config(path: Path, pooling_type: str, max_model_len: int | None) -> PoolerConfig:
    """What the directory says about pooling, with --pooling-type and --max-model-len applied."""
    cfg = _json(path / "config.json") or {}
    is_decoder = any(a.endswith(DECODER_SUFFIX) for a in cfg.get("architectures") or []) or cfg.get("is_decoder", False)
    st_pool = _json(path / "1_Pooling" / "config.json") or {}
    modules = _json(path / "modules.json")
    if pooling_type == "auto":
        if st_pool.get("pooling_mode_cls_token"):
            pooling_type = "cls"
        elif st_pool.get("pooling_mode_lasttoken"):
            pooling_type = "last"
        else:
            pooling_type = "last" if is_decoder and not st_pool else "mean"
    normalize = True  # OpenAI's and vLLM's embeddings are unit vectors
    if modules is not None:  # a sentence-transformers model normalizes only with a Normalize module
        normalize = any(m.get("type", "").endswith("Normalize") for m in modules)
    limit = cfg.get("max_position_embeddings") or 512
    st_len = (_json(path / "sentence_bert_config.json") or {}).get("max_seq_length")
    limit = min(limit, st_len or limit, max_model_len or limit)
    matryoshka = bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions"))
    return PoolerConfig(pooling_type, normalize, cfg["hidden_size"], limit, matryoshka, is_decoder)


class PoolingModel:
    def __init__(self, path: Path, config: PoolerConfig, device: torch.device, dtype: torch.dtype) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel

        self.config = config
        self.device = device
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=dtype).to(device).eval()
        self.pad_id = 0

    @torch.inference_mode()
    def pool(self, prompts: list[list[int]]) -> torch.Tensor:
        """(len(prompts), hidden_size) float32 on the CPU: one right-padded forward, then pooling."""
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        return self._pool(hidden.float(), mask.to(self.device), lengths.to(self.device)).cpu()

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        kind = self.config.pooling_type
        if kind == "cls":
            pooled = hidden[:, 0]
        elif kind == "last":
            pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        else:
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.config.normalize else pooled
