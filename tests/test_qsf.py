"""QSF: the file format round trip, checksums, truncation, conversion, and
running converted models (interpreter, native, streamed, compressed)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import runtime
from frontends.arch import ModelError
from frontends.convert import convert
from frontends.loader import load_model
from frontends.qsf import open_qsf, verify
from frontends.qsf_format import Header, group_header_size, LayerEntry, QSFError, pack_index, unpack_index
from frontends.qsf_writer import QSFLayer, QSFTensor, QSFWriter
from shared_data import MODELS, ROOT, needs_shared, reference_cases

RUNC = [c for c in reference_cases("stories260K_runc.json") if c["seed"] is None]
TOK = MODELS / "tok512.bin"


def lmc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)


@pytest.fixture(autouse=True)
def _private_stamps(tmp_path, monkeypatch):
    """Verification stamps in a fresh cache: a test never trusts an earlier test's check."""
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def stories_q8(tmp_path_factory) -> str:
    if not MODELS.is_dir():
        pytest.skip("../shared (models and references) is absent")
    out = str(tmp_path_factory.mktemp("qsf") / "stories260K-q8.qsf")
    convert(str(MODELS / "stories260K.bin"), out, "q8", tokenizer=str(TOK))
    return out


# --- the format on its own ---------------------------------------------------------------
def _header(**kw) -> Header:
    h = Header(version=1, arch="gemma3", qtype="mixed", activation="gelu_tanh", norm="rmsnorm",
               position="rope_neox", flags=0b11101, n_layers=2, dim=64, n_heads=2, n_kv_heads=1, vocab_size=128,
               context=4096, ffn_dim=128, head_dim=32, rope_theta=1e6, norm_eps=1e-6, rope_local_theta=1e4,
               sliding_window=512, swa_every=6, bos_id=2, eos_id=1, pad_id=0, index_offset=0,
               embedding_offset=0, final_offset=0, tokenizer_offset=0, file_size=0)
    return dataclasses.replace(h, **kw)


def _write_small(path: str, compression: str = "none") -> tuple[Header, list[LayerEntry]]:
    rng = np.random.default_rng(0)
    h = _header()
    entries = []
    with QSFWriter(path, h, compression, always_compress=compression != "none") as w:
        w.embedding([QSFTensor("token_embd", "F16", (128, 64), rng.standard_normal((128, 64)).astype(np.float16))])
        for i in range(2):
            t = [QSFTensor("attn_norm", "F32", (64,), np.ones(64, np.float32)),
                 QSFTensor("attn_q", "F16", (64, 64), np.zeros((64, 64), np.float16))]
            entries.append(w.layer(QSFLayer(t, "F16", importance=0.25 * (i + 1))))
        w.final([QSFTensor("output_norm", "F32", (64,), np.ones(64, np.float32))])
        w.tokenizer("llama2c", b"tokenizer bytes")
        header = w.header
    return header, entries


@pytest.mark.parametrize("compression", ["none", "lz4", "zstd"])
def test_header_and_index_round_trip(tmp_path, compression):
    path = str(tmp_path / "m.qsf")
    written, entries = _write_small(path, compression)
    qf = open_qsf(path)
    assert qf.header.as_dict() == written.as_dict()
    assert qf.layers == entries
    assert [e.compression for e in qf.layers] == [compression] * 2
    assert [e.importance for e in qf.layers] == [0.25, 0.5]
    assert qf.header.file_size == os.path.getsize(path)
    # every field survives pack -> unpack, including the f32 ones at their f32 value
    h2 = Header.unpack(written.pack())
    assert h2.as_dict() == written.as_dict()
    assert unpack_index(pack_index(entries), 2) == entries


def test_unknown_version_and_flags_are_refused():
    raw = bytearray(_header(file_size=1 << 20).pack())
    raw[4] = 2
    with pytest.raises(QSFError, match="version 2"):
        Header.unpack(bytes(raw))
    with pytest.raises(QSFError, match="flag"):
        Header.unpack(_header(flags=1 << 7).pack())


def test_failed_write_leaves_nothing(tmp_path):
    path = tmp_path / "m.qsf"
    with pytest.raises(RuntimeError):
        with QSFWriter(str(path), _header()) as w:
            w.embedding([QSFTensor("token_embd", "F16", (128, 64), np.zeros((128, 64), np.float16))])
            raise RuntimeError("conversion failed half-way")
    assert list(tmp_path.iterdir()) == []


def test_an_incomplete_file_is_refused_and_leaves_nothing(tmp_path):
    """The writer's own checks at the end (fewer layers than the header says):
    a ValueError, the temporary file removed (it was left behind, open)."""
    path = tmp_path / "m.qsf"
    with pytest.raises(ValueError, match="0 layers written, the header says 2"):
        with QSFWriter(str(path), _header()) as w:
            w.embedding([QSFTensor("token_embd", "F16", (128, 64), np.zeros((128, 64), np.float16))])
    assert list(tmp_path.iterdir()) == []


# --- corruption and truncation ---------------------------------------------------------------
def _sections(qf) -> dict[str, tuple[int, int]]:
    """Byte ranges that every flip must be caught in, by the name the error must give."""
    out = {"header": (0, 128), "index": (128, 128 + 8 + 40 * qf.header.n_layers + 4)}
    for s in qf.sections:
        head = 0 if s.name.startswith("layer") else 16
        out[s.name] = (s.offset - head, s.offset + s.stored)
    return out


@needs_shared
def test_every_flipped_byte_is_caught(stories_q8, tmp_path):
    """Every byte of the header and the index, and bytes spread over every
    other section (their tables and their data): the file, or the section
    when it is read, is refused with a message that names the section."""
    qf = open_qsf(stories_q8)
    data = open(stories_q8, "rb").read()
    rng = np.random.default_rng(1)
    bad = str(tmp_path / "bad.qsf")
    checked = 0
    for name, (lo, hi) in _sections(qf).items():
        if name in ("header", "index"):
            positions = range(lo, hi)
        else:
            positions = sorted({lo, lo + 1, hi - 1, *rng.integers(lo, hi, 12).tolist()})
        for pos in positions:
            buf = bytearray(data)
            buf[pos] ^= 1 << int(rng.integers(0, 8))
            with open(bad, "wb") as f:
                f.write(buf)
            with pytest.raises(ModelError) as e:
                load_model(bad)
            msg = str(e.value)
            assert bad in msg and name.split()[0] in msg, (name, pos, msg)
            if name.startswith("layer"):
                assert name in msg, (name, pos, msg)
            checked += 1
    assert checked > 128 + 40


@needs_shared
def test_truncated_file_is_refused_at_open(stories_q8, tmp_path):
    data = open(stories_q8, "rb").read()
    for n in (0, 10, 127, 128, 500, len(data) // 2, len(data) - 1):
        p = tmp_path / f"t{n}.qsf"
        p.write_bytes(data[:n])
        with pytest.raises(ModelError, match="truncated|shorter"):
            open_qsf(str(p))
    r = lmc("run", str(tmp_path / f"t{len(data) // 2}.qsf"), "-p", "x", "-n", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "truncated" in r.stderr


@needs_shared
def test_verified_file_is_remembered_and_rechecked_after_a_change(stories_q8, tmp_path):
    p = str(tmp_path / "m.qsf")
    shutil.copy(stories_q8, p)
    verify(open_qsf(p))
    buf = bytearray(open(p, "rb").read())
    qf = open_qsf(p)
    buf[qf.section("layer 2").offset + 1000] ^= 0x10
    open(p, "wb").write(buf)
    with pytest.raises(ModelError, match="layer 2: CRC32 mismatch"):
        verify(open_qsf(p))


# --- conversion --------------------------------------------------------------------------------------
@needs_shared
def test_llama2c_conversion_keeps_config_and_tokenizer(stories_q8):
    src = load_model(MODELS / "stories260K.bin", TOK)
    q = load_model(stories_q8)
    a, b = dataclasses.asdict(src.config), dataclasses.asdict(q.config)
    assert np.float32(a.pop("norm_eps")) == np.float32(b.pop("norm_eps"))
    assert a == b
    assert q.tokenizer.vocab == src.tokenizer.vocab
    assert np.array_equal(q.tokenizer.scores, src.tokenizer.scores)
    for text in ["Once upon a time", "Lily and Tom went to the park.", "x\ny  zz!"]:
        assert q.tokenizer.encode(text) == src.tokenizer.encode(text)
        assert runtime.load_tokenizer(stories_q8).encode(text) == src.tokenizer.encode(text)
    assert sorted(q.weights) == sorted(src.weights)


def _encode(tok, text: str):
    """ids, or the error's text with the file name taken out (a vocabulary without byte tokens refuses some input)"""
    try:
        return tok.encode(text)
    except ValueError as e:
        return str(e).split(": ", 1)[1]


@needs_shared
def test_gguf_conversion_keeps_config_and_tokenizer(tmp_path):
    gguf = MODELS / "TinyStories-656K-Q8_0.gguf"
    out = str(tmp_path / "ts.qsf")
    convert(str(gguf), out, "q4", compression="zstd")
    src, q = load_model(gguf), load_model(out)
    assert dataclasses.asdict(src.config) == dataclasses.asdict(q.config)
    for text in ["Once upon a time, there was a little girl.", "  spaces  and more", "Üñïçødé 123", "a\tb"]:
        assert _encode(q.tokenizer, text) == _encode(src.tokenizer, text)
    ids = src.tokenizer.encode("The cat sat on the mat.")
    assert q.tokenizer.decode(ids) == src.tokenizer.decode(ids)
    # the public tokenizer loader reads the same vocabulary from either file
    for path in (gguf, out):
        assert runtime.load_tokenizer(path).encode("The cat sat on the mat.") == ids
    # q4 logits follow the source's (a check of the quantizer through the file; measured 0.987 and 94%)
    ms, mq = runtime.load(gguf, backend="interp"), runtime.load(out, backend="interp")
    ids = ms.encode("Once upon a time, there was a little girl named Lily. She liked to play in the park.")
    ls, lq = ms.logits(ids), mq.logits(ids)
    assert np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(ls, lq)]) > 0.97
    assert (ls.argmax(1) == lq.argmax(1)).mean() >= 0.8


@needs_shared
@pytest.mark.parametrize("backend", ["interp", "llvm"])
def test_q8_reproduces_runc_greedy(stories_q8, backend):
    """stories260K in QSF q8 agrees with fp32 run.c for at least 50 tokens of every greedy case."""
    m = runtime.load(stories_q8, backend=backend, threads=2)
    for case in RUNC:
        got = list(m.generate(case["prompt_ids"], 50, temperature=0.0))
        assert got == case["generated_ids"][:50], case["prompt"]


@needs_shared
@pytest.mark.parametrize("qtype", ["q4", "q2", "ternary", "mixed"])
def test_native_equals_interpreter_on_every_qsf_type(qtype, tmp_path):
    """The float kernels (the pipeline without ``int_dot``; the integer
    path is ``test_int_qsf``'s) against the interpreter."""
    from compiler.pipeline import DEFAULT_PIPELINE

    out = str(tmp_path / f"s-{qtype}.qsf")
    convert(str(MODELS / "stories260K.bin"), out, qtype, tokenizer=str(TOK))
    case = RUNC[0]
    ids = case["prompt_ids"] + case["generated_ids"][:40]
    li = runtime.load(out, backend="interp", kv_type="f32").logits(ids)   # the kernels' numbers, not f16 rounding
    ln = runtime.load(out, backend="llvm", threads=2, passes=DEFAULT_PIPELINE, kv_type="f32").logits(ids)
    assert np.abs(li - ln).max() <= 1e-4 * np.abs(li).max()
    types = {w.type.layout for w in load_model(out).weights.values()}
    want = {"q4": "QSF_Q4", "q2": "QSF_Q2", "ternary": "QSF_TERNARY", "mixed": "QSF_Q4"}[qtype]
    assert want in types


@needs_shared
@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_compressed_layers_run_resident_and_streamed(codec, tmp_path, stories_q8):
    """Compressed layers give the same tokens as the plain file: in the
    interpreter, natively from the weight image, and streamed through the
    native reader, which decompresses on its I/O thread."""
    out = str(tmp_path / f"s-{codec}.qsf")
    r = convert(str(MODELS / "stories260K.bin"), out, "q8", tokenizer=str(TOK), compression=codec,
                always_compress=True)
    assert {e.compression for e in open_qsf(out).layers} == {codec}
    case = RUNC[0]
    want = list(runtime.load(stories_q8, backend="interp").generate(case["prompt_ids"], 40, temperature=0.0))
    for kw in ({"backend": "interp"}, {"backend": "llvm"}, {"backend": "llvm", "stream": "all"}):
        m = runtime.load(out, threads=2, **kw)
        assert list(m.generate(case["prompt_ids"], 40, temperature=0.0)) == want, kw
    stats = m.executor.stream_stats()
    # the reader read the stored (compressed) layers, not the decompressed sizes
    per_step = sum(e.stored for e in open_qsf(out).layers)
    assert stats["read_bytes"] % per_step == 0 or stats["read_bytes"] > per_step
    assert r.stored_layer_bytes == per_step


@needs_shared
def test_corrupt_compressed_layer_in_a_stream_is_an_error(tmp_path):
    """A layer that stops decompressing after it was verified (the file
    changed under a running model) is reported by the native reader."""
    out = str(tmp_path / "s.qsf")
    convert(str(MODELS / "stories260K.bin"), out, "q8", tokenizer=str(TOK), compression="lz4", always_compress=True)
    m = runtime.load(out, threads=1, stream="all")
    qf = open_qsf(out)
    sec = qf.section("layer 1")
    with open(out, "r+b") as f:   # same size: garble the start of the compressed data (LZ4 blocks carry no
        f.seek(sec.offset + group_header_size(len(sec.tensors)))   # checksum: changed literals would pass)
        f.write(b"\xff" * 200)
    fd = os.open(out, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    with pytest.raises(OSError, match="did not decompress|reading streamed weights failed"):
        for _ in range(3):
            list(m.generate([1, 2, 3], 5, temperature=0.0))


@needs_shared
def test_calibrated_mixed_spends_the_fixed_budget(tmp_path):
    text = (MODELS.parent / "eval" / "stories_eval.txt")
    out_fixed, out_cal = str(tmp_path / "fixed.qsf"), str(tmp_path / "cal.qsf")
    gguf = str(MODELS / "TinyStories-656K-Q8_0.gguf")
    fixed = convert(gguf, out_fixed, "mixed")
    cal = convert(gguf, out_cal, "mixed", calibration=str(text))
    assert cal.sensitivity and all(set(v) == {"QSF_Q2", "QSF_Q4", "QSF_Q8"} for v in cal.sensitivity.values())
    for name, errs in cal.sensitivity.items():   # more bits, less error, for every tensor
        assert errs["QSF_Q8"] < errs["QSF_Q4"] < errs["QSF_Q2"], name
    assert cal.layer_bytes <= fixed.layer_bytes
    imp = [e.importance for e in open_qsf(out_cal).layers]
    assert max(imp) == pytest.approx(1.0) and min(imp) > 0
    assert {cal.tensors[n] for n in cal.sensitivity} != {"QSF_Q4", "QSF_Q8"} or \
        [cal.tensors[n] for n in sorted(cal.sensitivity)] != [fixed.tensors[n] for n in sorted(cal.sensitivity)]


# --- the command line ----------------------------------------------------------------------------
@needs_shared
def test_cli_convert_inspect_and_errors(tmp_path):
    out = tmp_path / "m.qsf"
    r = lmc("convert", str(MODELS / "stories260K.bin"), str(out), "-z", str(TOK), "--qtype", "q4",
            "--compress", "zstd", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["output_bytes"] == out.stat().st_size and rep["tensor_types"]["QSF_Q4"] == 31
    r = lmc("inspect", str(out), "--json", "--verify")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    qf = open_qsf(str(out))
    assert info["format"] == "qsf" and info["header"]["n_layers"] == 5
    assert [l["stored"] for l in info["layers"]] == [e.stored for e in qf.layers]
    assert all(c["ok"] for c in info["checks"])
    # a flipped layer byte shows as a failed check, not a crash
    buf = bytearray(out.read_bytes())
    buf[qf.section("layer 3").offset + 3000] ^= 4
    out.write_bytes(buf)
    info = json.loads(lmc("inspect", str(out), "--json", "--verify").stdout)
    assert [c["what"] for c in info["checks"] if not c["ok"]] == ["layer 3 CRC32"]
    for args, msg in [(["--qtype", "q3"], "invalid choice"), (["--compress", "gzip"], "invalid choice"),
                      (["--calibration", str(tmp_path / "none.txt"), "--qtype", "mixed"], "calibration"),
                      (["--calibration", str(MODELS / "tok512.bin")], "needs --qtype mixed")]:
        r = lmc("convert", str(MODELS / "stories260K.bin"), str(tmp_path / "x.qsf"), "-z", str(TOK), *args)
        assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
        assert not list(tmp_path.glob("x.qsf*"))   # neither the file nor its temporary (.part) one
    r = lmc("convert", str(out), str(out))
    assert r.returncode == 2 and "overwrite" in r.stderr


@needs_shared
@pytest.mark.parametrize("source", ["qsf", "gguf"])
def test_artifact_of_a_model_with_its_own_tokenizer_runs(stories_q8, tmp_path, source):
    """A compiled artifact of a GGUF or QSF model runs (it used to pass the
    model's own path as a separate -z tokenizer and fail)."""
    model = stories_q8 if source == "qsf" else str(MODELS / "stories260K.gguf")
    art = str(tmp_path / "m.lmca")
    r = lmc("compile", model, "-o", art)
    assert r.returncode == 0, r.stderr
    r = lmc("run", art, "-p", "Once upon a time", "-n", "20", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    want = RUNC[0]["generated_ids"][:20]
    assert json.loads(r.stdout)["generated_ids"] == want


@needs_shared
def test_artifact_compiled_through_a_symlinked_folder_runs(tmp_path):
    """The tokenizer records its resolved path, the manifest the model path
    as given: through a symlinked folder they differed, and the artifact's
    own vocabulary was passed back as a -z tokenizer and refused."""
    link = tmp_path / "models"
    link.symlink_to(MODELS, target_is_directory=True)
    art = str(tmp_path / "m.lmca")
    r = lmc("compile", str(link / "stories260K.gguf"), "-o", art)
    assert r.returncode == 0, r.stderr
    r = lmc("run", art, "-p", "Once upon a time", "-n", "8", "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["generated_ids"] == RUNC[0]["generated_ids"][:8]
