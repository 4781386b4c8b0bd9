"""ragserve.gguf_file reads a GGUF header as the `gguf` package's reader does, and refuses a broken one."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from ragserve.gguf_file import read_gguf
from ragserve.model_source import resolve_model


def test_metadata_and_tensors_equal_gguf_readers():
    path = resolve_model("smollm2-135m").path
    ours, ref = read_gguf(path), GGUFReader(str(path))
    keys = {k for k in ref.fields if not k.startswith("GGUF.")}  # the reader's own header pseudo-fields
    assert set(ours.metadata) == keys
    for key in keys:
        value = ours.metadata[key]
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == pytest.approx(ref.fields[key].contents())
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
    assert len({t.tensor_type for t in ours.tensors}) >= 2  # plain (norms) and quantized (Q4_1 rows) both read


@pytest.mark.parametrize(
    ("cut", "message"),
    [(lambda b: b"GGML" + b[4:], "not a GGUF file"), (lambda b: b[:4] + b"\x07" + b[5:], "version 7"),
     (lambda b: b[:5000], "malformed GGUF header"), (lambda b: b[: len(b) // 2], "past the end")],
)  # fmt: skip
def test_a_broken_file_is_a_clear_error(tmp_path, cut, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(cut(resolve_model("smollm2-135m").path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        read_gguf(path)
