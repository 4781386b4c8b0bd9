"""Model resolution, identity and the shared tokenizer, against transformers."""

import pytest

from ragserve.model_source import load_tokenizer, model_fingerprint, model_metadata, resolve_model
from tests.helpers.tiny_models import CONFIGS, tiny_model


def test_default_alias_resolves_to_gguf():
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.path.is_file()
    meta = model_metadata(source)
    assert (meta["architecture"], meta["num_layers"], meta["hidden_size"]) == ("llama", 30, 576)
    assert (meta["num_heads"], meta["num_kv_heads"], meta["vocab_size"]) == (9, 3, 49152)


def test_paths_resolve_and_bad_paths_fail(tmp_path):
    path = tiny_model("llama")
    assert resolve_model(str(path)).kind == "hf"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="unknown model"):
        resolve_model(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "arch", [a for a, c in sorted(CONFIGS.items()) if any(isinstance(v, dict) for v in c.values())]
)
def test_a_tiny_model_created_in_this_process_is_the_one_later_calls_return(arch, tmp_path, monkeypatch):
    """Creating a model must not change the config its tag is computed from (transformers edits nested
    dicts such as rope_scaling in place): a second call found another directory, so another model id and KV
    keys, and an engine that fetched a peer's blocks found none (test_kv_connector on a cold cache)."""
    monkeypatch.setenv("RAGSERVE_CACHE_DIR", str(tmp_path))
    first = tiny_model(arch)
    assert tiny_model(arch) == first
    assert [p.name for p in (tmp_path / "tiny-models").iterdir()] == [first.name]


def test_fingerprint_tells_weights_apart_not_names():
    a = resolve_model(str(tiny_model("llama", seed=0)), served_name="same")
    b = resolve_model(str(tiny_model("llama", seed=1)), served_name="same")
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(a)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_tiny_models_load_in_transformers(arch):
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == CONFIGS[arch]["model_type"]
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()


def test_tiny_model_sharded_matches_single_file():
    from safetensors.torch import load_file

    single = load_file(str(tiny_model("llama") / "model.safetensors"))
    sharded_dir = tiny_model("llama", sharded=True)
    shards = sorted(sharded_dir.glob("model-*.safetensors"))
    assert len(shards) > 1
    merged = {k: v for s in shards for k, v in load_file(str(s)).items()}
    assert merged.keys() == single.keys()
    assert all((merged[k] == single[k]).all() for k in single)


def test_tokenizer_and_chat_template_match_transformers():
    from transformers import AutoTokenizer

    source = resolve_model("smollm2-135m")
    ours = load_tokenizer(source)
    ref = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    messages = [
        {"role": "system", "content": "Answer from the context."},
        {"role": "user", "content": "Context: ragserve caches KV blocks.\n\nQuestion: what is cached?"},
    ]
    text = "Hello, wörld! RAG serving 123"
    assert ours.encode(text) == ref(text).input_ids
    assert ours.render_chat(messages) == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ours.encode_chat(messages) == list(expected)
    assert ours.decode(ours.encode(text)) == text
    assert ours.eos_token_id == ref.eos_token_id


def test_gguf_tokenizer_exported_cached_and_shared_by_tiny_models():
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    assert tok.vocab_size == 49152 and tok.eos_token_id == 2
    tiny = load_tokenizer(resolve_model(str(tiny_model("qwen3"))))
    assert tiny.fingerprint() == tok.fingerprint()


def test_text_parts_render_like_a_plain_string():
    tok = load_tokenizer(resolve_model("smollm2-135m"))
    plain = [{"role": "user", "content": "Context: abc. Question: why?"}]
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Context: abc. "}, {"type": "text", "text": "Question: why?"}],
        }
    ]
    assert tok.encode_chat(parts) == tok.encode_chat(plain)
    with pytest.raises(ValueError, match="only text content parts"):
        tok.encode_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
