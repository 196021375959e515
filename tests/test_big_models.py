"""Models larger than memory: weights streamed into the package one tensor at
a time (copied straight from a mapped checkpoint), a checkpoint in another
dtype converted on disk, the memory budget."""

from __future__ import annotations

import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import kvexport.contract.safetensors_io as sio
import kvexport.exporter.sources.models as models
from helpers import export_tiny
from kvexport.cli.main import main
from kvexport.exporter.sources.architectures import ARCHITECTURES
from kvexport.exporter.sources.mapped import source_ranges
from kvexport.exporter.pipeline import write_weights

needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-llama as a Hugging Face directory, in fp32, split over two shards."""
    directory = tmp_path_factory.mktemp("ckpt") / "tiny-llama-hf"
    model = models.load_model("tiny-llama").model
    model.save_pretrained(str(directory), max_shard_size="300KB")
    assert len(list(directory.glob("*.safetensors"))) >= 2
    return directory


def test_writer_matches_save_file_byte_for_byte(tmp_path):
    tensors = {
        "b": torch.randn(3), "a": torch.randn(2, 2).to(torch.bfloat16), "c": torch.arange(5, dtype=torch.int8),
        "scalar": torch.tensor(2.5), "e": torch.tensor([7]), "f": torch.randn(2).half(), "empty": torch.zeros(0),
        "mask": torch.tensor([True, False, True]), "view": torch.randn(40, 7)[:, 2],  # not contiguous
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.st"), metadata={"format": "pt"})
    sio.write_safetensors(tmp_path / "ours.st", tensors, {"format": "pt"})
    assert (tmp_path / "ours.st").read_bytes() == (tmp_path / "ref.st").read_bytes()


def test_ranges_copied_in_chunks_with_their_dtype_converted(tmp_path, monkeypatch):
    values = {"w": torch.randn(33, 7), "n": torch.arange(10, dtype=torch.int64)}
    save_file(values, str(tmp_path / "src.st"))
    ranges, _ = sio.read_header(tmp_path / "src.st")
    monkeypatch.setattr(sio, "CHUNK", 12)  # many chunks, each a whole number of elements
    with sio.SafetensorsWriter(tmp_path / "out.st", {"w": (torch.bfloat16, (33, 7)), "n": (torch.int64, (10,))}) as out:
        for name in out.names:
            out.write(name, ranges[name])
    back = load_file(str(tmp_path / "out.st"))
    assert torch.equal(back["w"], values["w"].to(torch.bfloat16))
    assert torch.equal(back["n"], values["n"])


def test_writer_refuses_a_wrong_shape_or_order_and_a_short_file(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        with sio.SafetensorsWriter(tmp_path / "x.st", {"a": (torch.float32, (2,))}) as out:
            out.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="expected 'a'"):
        with sio.SafetensorsWriter(tmp_path / "y.st", {"a": (torch.float32, (2,)), "b": (torch.float32, (2,))}) as out:
            out.write("b", torch.zeros(2))
    with pytest.raises(ValueError, match="never written"):
        with sio.SafetensorsWriter(tmp_path / "z.st", {"a": (torch.float32, (2,))}):
            pass


@needs_proc
def test_mapped_weights_are_copied_from_the_file_and_written_ones_are_not(checkpoint, tmp_path):
    loaded = models.load_model(str(checkpoint))
    tensors = {k: v for k, v in loaded.model.state_dict().items()}
    ranges = source_ranges(tensors, loaded.weight_files)
    stored = {r.name for r in ranges.values()}
    assert stored == {k for f in loaded.weight_files for k in sio.read_header(f)[0]}, "every checkpoint tensor is mapped"
    # a weight changed in place is no longer the file's bytes: its shard is written from memory
    name = "model.layers.0.mlp.up_proj.weight"
    with torch.no_grad():
        tensors[name].mul_(2)
    after = source_ranges(tensors, loaded.weight_files)
    assert name not in after
    write_weights(tmp_path / "w.st", tensors, loaded.weight_files, progress=lambda m: None)
    back = load_file(str(tmp_path / "w.st"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_export_from_a_checkpoint_streams_and_matches_the_builtin(checkpoint, tmp_path, tiny_package):
    """The same weights through the file path (copied from the mapped
    checkpoint) and the in-memory path (the built-in) store the same tensors."""
    export_tiny(str(checkpoint), tmp_path / "pkg")
    ours = load_file(str(tmp_path / "pkg" / "weights.safetensors"))
    builtin = load_file(str(tiny_package("tiny-llama") / "weights.safetensors"))
    assert ours.keys() == builtin.keys()
    assert all(torch.equal(ours[k], builtin[k]) for k in ours)


@needs_proc
def test_a_checkpoint_in_another_dtype_is_converted_on_disk_and_mapped(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "CONVERT_ON_DISK_BYTES", 1)
    assert models.source_weights(str(checkpoint), "bf16").private_bytes == 0
    loaded = models.load_model(str(checkpoint), "bf16")
    assert all(str(f).startswith(str(tmp_path / "cache" / "converted")) for f in loaded.weight_files)
    original = {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    state = loaded.model.state_dict()
    assert all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in original.items())
    assert len(source_ranges(state, loaded.weight_files)) >= len(original), "the converted weights are mapped"
    assert loaded.provenance["source"]["path"] == checkpoint.name  # the source, not the cache


def test_memory_budget_refuses_before_loading(checkpoint, tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("kvexport.exporter.pipeline.load_model", never)
    result = CliRunner().invoke(main, [
        "export", str(checkpoint), "-o", str(tmp_path / "pkg"), "--use-offgraph-kv-cache", "--forward-sizes", "1,2", "--max-step-tokens", "24",
        "--max-memory", "300MB", "--backend", "aoti", "--compile-workers", "2"])
    assert result.exit_code == 1
    assert "--max-memory 0.30 GB" in result.output and "--compile-workers 1" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("text, expected", [("4GB", 4 * 10**9), ("512 MiB", 512 * 2**20), ("2.5G", 25 * 10**8)])
def test_memory_sizes(text, expected):
    from kvexport.exporter.memory import parse_size

    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "4 XB", "-1GB", "0"])
def test_bad_memory_sizes_are_named(text):
    from kvexport.contract.errors import SpecError
    from kvexport.exporter.memory import parse_size

    with pytest.raises(SpecError, match="--max-memory"):
        parse_size(text)


def test_report_holds_the_memory_plan_and_peak(checkpoint, tmp_path):
    result = export_tiny(str(checkpoint), tmp_path / "pkg", max_memory="8GB")
    memory = result.memory
    assert memory["budget_mb"] == pytest.approx(8e9 / 2**20, rel=1e-3)
    assert 0 < memory["plan_private_mb"] and 0 < memory["peak_private_mb"] <= memory["peak_rss_mb"]
    assert all("peak_tree_private_mb" in row for row in result.steps)


def _tiny_gguf(path, seed=0):
    """A small Llama GGUF written with gguf's own writer: Q8_0 matrices, F32
    norms, and no output.weight (tied embeddings), as llama.cpp writes one."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    hidden, heads, kv_heads, ffn, layers, vocab = 64, 4, 2, 128, 2, 96
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(seed)

    def matrix(name, rows, cols):
        values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        writer.add_tensor(name, quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)

    matrix("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    head_dim = hidden // heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_streams_to_what_transformers_dequantizes(tmp_path, monkeypatch):
    """Tensor by tensor, the streamed conversion equals transformers' own
    GGUF loading (dequantized, Q/K rows un-permuted, names mapped)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    monkeypatch.setenv("KVEXPORT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    plan = models.source_weights(str(gguf), "fp32")  # before conversion: one tensor at a time is held
    assert plan.private_bytes == models.GGUF_HELD_COPIES * 128 * 64 * 4 < plan.export_bytes  # the largest: ffn [128, 64]
    loaded = models.load_model(str(gguf))
    [weights] = loaded.weight_files
    ours = load_file(str(weights))
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert ours.keys() == theirs.keys() and len(ours) == 2 + 9 * 2
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor.float()), name
    assert loaded.model.config.num_key_value_heads == 2 and loaded.model.config.tie_word_embeddings


@pytest.mark.parametrize("arch", sorted(a.key for a in ARCHITECTURES.values()))
def test_geometry_probed_without_reading_a_weight_equals_the_real_run(arch, monkeypatch, caplog):
    """The cache geometry comes from a decoder run under fake tensors (no
    weight read); it must equal what a real run sees."""
    import logging

    import torch._subclasses.fake_tensor as fake
    from kvexport.exporter.forwards import OffgraphForward

    with caplog.at_level(logging.INFO, logger="kvexport.exporter.forwards"):
        faked = OffgraphForward(models.load_model(f"tiny-{arch}").model).geometry
    assert "fake tensors failed" not in caplog.text

    class Refused:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("no fake run")

    monkeypatch.setattr(fake, "FakeTensorMode", Refused)
    real = OffgraphForward(models.load_model(f"tiny-{arch}").model).geometry
    assert faked == real


def test_geometry_probe_runs_on_the_models_device():
    """A model on another device than the CPU (meta stands in for CUDA here)
    is probed there: no tensor of the probe is made on the CPU."""
    from kvexport.exporter.forwards import OffgraphForward

    on_cpu = OffgraphForward(models.load_model("tiny-llama").model).geometry
    elsewhere = OffgraphForward(models.load_model("tiny-llama").model.to("meta")).geometry
    assert elsewhere == on_cpu
