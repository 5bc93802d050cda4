"""``lmc inspect``: reports agree with the gguf package's own reader and
with the llama2.c layout, render as text and JSON, and bad files fail cleanly."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from frontends.arch import ModelConfig, ModelError
from frontends.synth import synth_llama2c, write_synth_tokenizer
from runtime.cli.inspect import human_size, render_text
from runtime.models import BUNDLED_MODEL, BUNDLED_TOKENIZER
from runtime.tools.inspect_report import inspect_file
from shared_data import MODELS, ROOT, needs_shared

GGUFS = ["stories260K.gguf", "TinyStories-656K-Q8_0.gguf"]
TINY = ModelConfig(arch="llama", dim=16, hidden_dim=32, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=300,
                   seq_len=16)


def lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


def assert_sections_tile(report: dict) -> None:
    """Sections start at 0, follow each other without gap or overlap and end at the file's end."""
    s = report["sections"]
    assert s[0]["offset"] == 0
    for a, b in zip(s, s[1:]):
        assert a["offset"] + a["size"] == b["offset"], (a, b)
    assert s[-1]["offset"] + s[-1]["size"] == report["size"]
    assert sum(x["size"] for x in s) == report["size"]


@needs_shared
@pytest.mark.parametrize("name", GGUFS)
def test_gguf_report_matches_the_gguf_reader(name):
    from gguf import GGUFReader

    path = str(MODELS / name)
    reader = GGUFReader(path, "r")
    r = inspect_file(path)
    assert r["format"] == "gguf" and r["size"] == (MODELS / name).stat().st_size
    h = r["header"]
    assert h["version"] == int(reader.fields["GGUF.version"].parts[-1][0])
    assert h["tensor_count"] == len(reader.tensors) == int(reader.fields["GGUF.tensor_count"].parts[-1][0])
    assert h["metadata_kv_count"] == int(reader.fields["GGUF.kv_count"].parts[-1][0])
    assert h["alignment"] == reader.alignment
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert h["general.architecture"] == arch
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    assert h["tokenizer.ggml.tokens"] == f"[{n_vocab} strings]"  # the length, never the array
    assert [t["name"] for t in r["tensors"]] == [t.name for t in reader.tensors]
    assert [t["type"] for t in r["tensors"]] == [t.tensor_type.name for t in reader.tensors]
    assert [t["offset"] for t in r["tensors"]] == [int(t.data_offset) for t in reader.tensors]
    assert [t["nbytes"] for t in r["tensors"]] == [int(t.n_bytes) for t in reader.tensors]
    assert [t["shape"] for t in r["tensors"]] == [[int(d) for d in reversed(t.shape)] for t in reader.tensors]
    data = next(s for s in r["sections"] if s["name"] == "tensor data")
    assert data["offset"] == reader.data_offset
    assert_sections_tile(r)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    assert {k: v["count"] for k, v in r["summary"]["types"].items()} == counts
    assert r["summary"]["total_weight_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert all(c["ok"] for c in r["checks"]), r["checks"]
    assert r["config"]["n_layers"] == len(r["layers"])


@needs_shared
@pytest.mark.parametrize("name,version", [("stories260K.bin", 0), ("stories260K-q8.bin", 2)])
def test_llama2c_sections_tile_the_file(name, version):
    r = inspect_file(str(MODELS / name))
    assert r["format"] == f"llama2c-v{version}"
    assert_sections_tile(r)
    assert r["header"]["dim"] == r["config"]["dim"] == 64
    if version == 2:
        assert r["header"]["group_size"] == 8 and r["header"]["version"] == 2
    assert all(c["ok"] for c in r["checks"]), r["checks"]


@pytest.mark.parametrize("version", [0, 1, 2])
def test_llama2c_every_version(tmp_path, version):
    path = tmp_path / f"tiny_v{version}.bin"
    synth_llama2c(TINY, path, version=version, group_size=8)
    r = inspect_file(str(path))
    assert r["format"] == f"llama2c-v{version}"
    assert_sections_tile(r)
    names = [s["name"] for s in r["sections"]]
    assert names[0] == "header" and r["sections"][0]["size"] == (28 if version == 0 else 256)
    assert ("freq_cis_real + freq_cis_imag (unused)" in names) == (version == 0)
    assert r["header"]["shared_classifier"] is True
    assert sum(t["nbytes"] for t in r["tensors"]) == r["summary"]["total_weight_bytes"]
    assert all(c["ok"] for c in r["checks"]), r["checks"]
    assert "tokenizer" not in r  # none given, none beside the model


def test_llama2c_tokenizer_is_checked(tmp_path):
    model = tmp_path / "tiny.bin"
    synth_llama2c(TINY, model)
    write_synth_tokenizer(tmp_path / "tok300.bin", 300)
    r = inspect_file(str(model))
    assert r["tokenizer"]["vocab_size"] == 300
    write_synth_tokenizer(tmp_path / "other.bin", 200)
    r = inspect_file(str(model), tokenizer=str(tmp_path / "other.bin"))
    assert not next(c for c in r["checks"] if "tokenizer" in c["what"])["ok"]


def test_text_renderer_has_the_key_facts():
    r = inspect_file(BUNDLED_MODEL, BUNDLED_TOKENIZER)
    text = render_text(r)
    for fact in ("llama2c-v0", f"{r['size']:,} bytes", "dim: 64", "n_layers: 5", "sections", "token_embd",
                 "weights by type", "F32", "bits per weight", "checks", "OK", "47 tensors (--tensors lists them)"):
        assert fact in text, fact
    assert "FAIL" not in text
    listed = render_text(r, show_tensors=True)
    assert "blk.4.ffn_up" in listed.split("\ntensors\n")[1]


def test_layer_table_of_a_layered_format():
    """QSF reports carry layers with stored/decompressed sizes and CRCs; the renderer shows the ratio."""
    r = {"format": "test", "path": "x", "size": 100,
         "layers": [{"index": 0, "offset": 10, "stored": 30, "decompressed": 60, "crc": 0xDEADBEEF, "crc_ok": True},
                    {"index": 1, "offset": 40, "stored": 50, "decompressed": 100, "crc": 1, "crc_ok": False}]}
    text = render_text(r)
    assert "0.500" in text and "deadbeef" in text and "OK" in text and "BAD" in text


def test_human_size():
    assert human_size(100) == "100 B"
    assert human_size(12_897_484) == "12.3 MiB"


def test_failed_checks_are_reported_not_raised(tmp_path):
    """A tensor type lmc does not read and missing hyper-parameters: the report says so, exit 1."""
    import gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor_info("token_embd.weight", [4, 66], np.dtype(np.uint8), 264, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.write_tensor_data(np.zeros((4, 66), np.uint8))
    w.close()
    r = inspect_file(str(path))
    failed = {c["what"] for c in r["checks"] if not c["ok"]}
    assert failed == {"tensor sizes match their types (lmc's layouts)", "lmc can load the model"}
    assert "config" not in r
    res = lmc("inspect", str(path))
    assert res.returncode == 1 and "FAIL" in res.stdout and "IQ2_XXS" in res.stdout


# --- CLI -------------------------------------------------------------------------

def test_cli_json_parses():
    r = lmc("inspect", BUNDLED_MODEL, "--json", "--verify")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["format"] == "llama2c-v0" and len(out["tensors"]) == 47
    assert any("finite" in c["what"] and c["ok"] for c in out["checks"])


@needs_shared
def test_cli_gguf_text():
    r = lmc("inspect", str(MODELS / "TinyStories-656K-Q8_0.gguf"), "--tensors")
    assert r.returncode == 0, r.stderr
    for fact in ("gguf", "tensor_count: 20", "general.name: Raincandy U TinyStories 656K",
                 "tokenizer.ggml.tokens: [2048 strings]", "header + metadata", "tensor infos", "tensor data",
                 "Q8_0", "blk.1.ffn_up.weight"):
        assert fact in r.stdout, fact


def _truncate(src, dst, n: int) -> str:
    dst.write_bytes(open(src, "rb").read(n))
    return str(dst)


@pytest.fixture
def tiny_gguf(tmp_path):
    from frontends.gguf_writer import write_gguf
    from frontends.synth import synth_tensor

    cfg = ModelConfig(arch="llama", dim=32, hidden_dim=64, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=300,
                      seq_len=16)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, cfg, lambda n: synth_tensor(cfg, n), "Q8_0")
    return path


@pytest.mark.parametrize("where,message", [("header + metadata", "ends inside the GGUF metadata"),
                                           ("tensor infos", "ends inside the GGUF tensor infos"),
                                           ("tensor data", "truncated: tensor ")])
def test_truncated_gguf_is_one_line(tmp_path, tiny_gguf, where, message):
    full = inspect_file(str(tiny_gguf))
    assert all(c["ok"] for c in full["checks"])
    sec = next(s for s in full["sections"] if s["name"] == where)
    path = _truncate(tiny_gguf, tmp_path / "cut.gguf", sec["offset"] + sec["size"] // 2)
    r = lmc("inspect", path)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmc: error: {path}: truncated"), r.stderr
    assert message in lines[0]


def test_an_unknown_tensor_type_is_named(tmp_path, tiny_gguf):
    """A tensor info whose type number no GGUF reader knows: one line that
    names the tensor and the number, not only "not a readable GGUF file"."""
    import struct

    data = tiny_gguf.read_bytes()
    key = b"token_embd.weight"
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    bad = bytearray(data)
    struct.pack_into("<I", bad, at + 4 + 8 * n_dims, 99)
    path = tmp_path / "type99.gguf"
    path.write_bytes(bytes(bad))
    r = lmc("inspect", str(path))
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "token_embd.weight has an unknown type 99" in lines[0], r.stderr


def test_a_big_endian_gguf_is_reported_as_the_little_endian_one(tmp_path):
    """The header walk reads either byte order (``frontends.gguf_parse.gguf_layout``)."""
    import gguf

    reports = []
    for order in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        path = tmp_path / f"{order.name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama", endianess=order)
        w.add_array("t.strs", ["a", "bc"])
        w.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        reports.append(inspect_file(str(path)))
    little, big = reports
    assert big["header"]["version"] == little["header"]["version"] == 3
    assert big["header"]["alignment"] == 32 and big["header"]["tensor_count"] == 1
    assert big["sections"] == little["sections"] and big["tensors"] == little["tensors"]
    assert_sections_tile(big)


def test_gguf_magic_alone_raises(tmp_path):
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="truncated: .* ends inside the GGUF header"):
        inspect_file(str(path))


def test_truncated_llama2c_is_one_line(tmp_path):
    path = _truncate(BUNDLED_MODEL, tmp_path / "cut.bin", 100_000)
    r = lmc("inspect", path)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated" in lines[0] and path in lines[0], r.stderr


@pytest.mark.parametrize("args,message", [(("/nonexistent.gguf",), "no such file"),
                                          (("GGUF", "-z", BUNDLED_TOKENIZER), "-z is for llama2.c")])
def test_cli_errors(tmp_path, args, message):
    from frontends.gguf_writer import write_gguf
    from frontends.synth import synth_tensor

    if "GGUF" in args:
        write_gguf(tmp_path / "t.gguf", TINY, lambda n: synth_tensor(TINY, n), "F32")  # F32: any dim
        args = tuple(str(tmp_path / "t.gguf") if a == "GGUF" else a for a in args)
    r = lmc("inspect", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
