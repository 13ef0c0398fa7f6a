"""ktlong.gguffile against gguf's own GGUFReader, and the converted config + tokenizer that a
GGUF's later loads read from KTLONG_HOME."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ktlong.gguffile import GGUFFile
from ktlong.quant import quantize


def _same_as_gguf_reader(path: Path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert ours.data_offset == ref.data_offset
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        a, b = ours.get_field(k), ref.fields[k]
        assert a.raw() == b"".join(bytes(p) for p in b.parts), k
        assert a.contents() == b.contents(), k
        if len(b.data) > 1:  # an array: one element from its end
            assert len(a) == len(b.data)
            assert a.contents(len(a) - 1) == b.contents(len(b.data) - 1), k
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes,
                a.data_offset) == (b.name, b.tensor_type, b.shape.tolist(), b.n_elements,
                                   b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_every_value_type_and_tensor_type_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcode ✓")
    w.add_uint64("t.u64", 2**63 + 7)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -1.5e-300)
    w.add_array("t.strs", ["", "a", "▁the", "<bos>", "é" * 300])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.0])
    w.add_array("t.bools", [True, False, True])
    w.add_string("t.empty", "")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 256)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    for name in ("Q8_0", "Q4_1", "Q4_K", "Q6_K"):
        qt = gguf.GGMLQuantizationType[name]
        w.add_tensor(name.lower(), quantize(x, name), raw_dtype=qt)
    w.add_tensor("vec", x[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = _same_as_gguf_reader(path)
    assert f.get_field("t.strs").contents(4) == "é" * 300
    assert f.get_field("t.u64").contents() == 2**63 + 7
    assert f.get_field("missing") is None


def test_the_real_models_files_read_as_gguf_reads_them(ktlong_home: Path) -> None:
    from ktlong.registry import resolve_model

    f = _same_as_gguf_reader(resolve_model("smollm2"))
    assert len(f.get_field("tokenizer.ggml.tokens")) == 49152


def test_a_damaged_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strs", ["word"] * 100)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"t.strs") + len(b"t.strs") + 4 + 4 + 8
    data[at:at + 8] = (10**9).to_bytes(8, "little")  # the first string's length: 1 GB
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(path)


def test_a_gguf_tokenizer_is_converted_once_then_read_from_home(
        tmp_path: Path, ktlong_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from ktlong.model import load_model, load_tokenizer
    from ktlong.tinymodel import make_model, write_gguf

    hf = make_model(tmp_path / "hf", "llama")
    path = write_gguf(hf, tmp_path / "m.gguf", "Q8_0")
    first = load_tokenizer(path)
    saved = list((ktlong_home / "gguf").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").is_file()
    assert (saved[0] / "config.json").is_file()
    converted = []
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig):
        def spy(*a: object, _real=cls.from_pretrained, **k: object) -> object:
            converted.append("gguf_file" in k)
            return _real(*a, **k)
        monkeypatch.setattr(cls, "from_pretrained", spy)
    again = load_tokenizer(path)
    assert not any(converted)  # the second load reads the saved files
    text = "The pass key is 71942. Remember it.\n" * 3
    assert again(text).input_ids == first(text).input_ids
    assert (again.bos_token, again.eos_token) == (first.bos_token, first.eos_token)
    lm = load_model(path, device="CPU")  # reads the saved config and tokenizer
    assert lm.tokenizer(text).input_ids == first(text).input_ids
    fresh = transformers.AutoConfig.from_pretrained(tmp_path, gguf_file="m.gguf").to_dict()
    ours = transformers.AutoConfig.from_pretrained(saved[0]).to_dict()
    drop = {"_name_or_path", "transformers_version", "head_dim"}  # head_dim: load_model sets it
    assert {k: v for k, v in ours.items() if k not in drop} == {
        k: v for k, v in fresh.items() if k not in drop}
    (saved[0] / "tokenizer.json").write_text("{")  # damaged: converted again, then replaced
    assert load_tokenizer(path)(text).input_ids == first(text).input_ids
    assert (saved[0] / "tokenizer.json").stat().st_size > 100
