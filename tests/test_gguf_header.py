"""kvflow's GGUF header reader against gguf.GGUFReader (the reference) on the real file."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from kvflow.errors import ModelLoadError
from kvflow.models.gguf_file import _dequantize, _file_bytes
from kvflow.models.gguf_header import read_gguf_header
from kvflow.models.registry import embedded_model_path


@pytest.fixture(scope="module")
def smollm2_gguf() -> str:
    return str(embedded_model_path("smollm2-135m"))


def test_header_matches_gguf_reader(smollm2_gguf):
    ref = gguf.GGUFReader(smollm2_gguf)
    ours = read_gguf_header(smollm2_gguf)
    assert ours.fields.keys() == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, value in ours.fields.items():
        assert value == ref.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert (t.shape, t.ggml_type, t.offset) == (tuple(int(x) for x in r.shape),
                                                     int(r.tensor_type), r.data_offset)
    # The same weights after dequantization, quantized and unquantized tensors alike.
    for t, r in list(zip(ours.tensors, ref.tensors))[:12]:
        want = gguf.quants.dequantize(r.data, r.tensor_type).reshape(t.numpy_shape)
        np.testing.assert_array_equal(_dequantize(smollm2_gguf, _file_bytes(smollm2_gguf), t),
                                      want)


def test_prefix_keeps_only_those_keys(smollm2_gguf):
    h = read_gguf_header(smollm2_gguf, prefix="tokenizer.", tensors=False)
    assert h.fields and all(k.startswith("tokenizer.") or k == "general.alignment"
                            for k in h.fields)
    assert h.tensors == ()


@pytest.mark.parametrize("version", [1, 0x03000000])  # v1; a big-endian v3 reads like this
def test_unsupported_versions_are_refused(tmp_path, version):
    path = tmp_path / "old.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, 0, 0))
    with pytest.raises(ModelLoadError, match="version"):
        read_gguf_header(str(path))
