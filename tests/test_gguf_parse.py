"""The direct GGUF header parser gives what the gguf package's reader gives."""
from __future__ import annotations

import numpy as np
import pytest

from frontends.gguf import metadata_from_reader
from frontends.gguf_parse import parse_gguf
from frontends.string_table import StringArray


def _write(path, with_tensors: bool = True, big_endian: bool = False) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -3000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_string("t.empty_str", "")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï", "<|im_start|>"])
    w.add_array("t.empty", [])
    w.add_key_value("t.bools", [True, False], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
    if with_tensors:
        w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add_tensor("b.weight", np.ones((2, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("with_tensors,big_endian", [(True, False), (False, False), (True, True)])
def test_parser_matches_the_package_reader(tmp_path, with_tensors, big_endian):
    from gguf import GGUFReader

    path = tmp_path / "t.gguf"
    _write(path, with_tensors, big_endian)
    meta, tensors = parse_gguf(str(path))
    reader = GGUFReader(str(path), "r")
    want = metadata_from_reader(reader)
    assert list(meta) == list(want)
    for k, v in want.items():
        got = meta[k]
        if isinstance(v, np.ndarray):
            assert got.dtype == v.dtype and np.array_equal(got, v), k
        elif isinstance(v, StringArray):
            assert isinstance(got, StringArray) and list(got) == list(v), k
        else:
            assert type(got) is type(v) and got == v, k
    assert tensors == [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape), int(t.data_offset),
                        int(t.n_bytes)) for t in reader.tensors]


def test_parser_refuses_every_truncation(tmp_path):
    """Cut anywhere in the header, the parser raises ValueError (never reads
    past the end, never returns a partial result)."""
    path = tmp_path / "t.gguf"
    _write(path)
    data = path.read_bytes()
    _, tensors = parse_gguf(str(path))
    header_end = min(off for _, _, _, off, _ in tensors)
    cut = tmp_path / "cut.gguf"
    for n in range(0, header_end + 1, 7):
        cut.write_bytes(data[:n])
        with pytest.raises(ValueError):
            parse_gguf(str(cut))


def test_a_lying_string_length_is_refused(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path, with_tensors=False)
    data = bytearray(path.read_bytes())
    i = data.index(b"ab") if b"ab" in data else data.index("ünï".encode()) - 8
    data[i: i + 8] = (1 << 62).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="past the end"):
        parse_gguf(str(path))
