"""A GGUF file converted to a Hugging Face directory one tensor at a time.

transformers' own GGUF loading dequantizes every tensor into memory before
it builds the model (a 7B Q4 file becomes 30 GB of fp32). Here each tensor
goes through the same steps transformers takes (gguf's `dequantize`, the
architecture's TensorProcessor, the GGUF-to-HF name map), is appended to a
scratch file, and is freed; the safetensors file is then written from
ranges of the scratch file in its sorted order. At most one tensor is held.
The config and tokenizer come from the GGUF's metadata, read by
transformers as before."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from kvexport.contract.errors import ModelError
from kvexport.exporter.sources.gguf_header import check_gguf_header
from kvexport.contract.safetensors_io import SafetensorsWriter, TensorRange, write_bytes

log = logging.getLogger(__name__)


def convert_gguf(gguf: Path, out: Path, progress: Callable[[str], None], resolve: Callable) -> None:
    """Writes config.json, generation_config.json, the tokenizer and
    model.safetensors (fp32) for `gguf` into the directory `out`."""
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint, read_field,
    )

    # every reader below (transformers' included) trusts the header's counts
    check_gguf_header(gguf)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the directory holds plain fp32 weights
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = config.architectures or [type(skeleton).__name__]
    resolve(config, str(gguf))
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)  # the metadata transformers' processors read
    reader = GGUFReader(str(gguf))
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    names = get_gguf_hf_weights_map(skeleton, processor)
    parsed["tensors"] = {}  # some processors (fused experts) leave their results here
    scratch_path = out / ".tensors.scratch"
    ranges: dict[str, TensorRange] = {}
    total = len(reader.tensors)
    start = last = time.perf_counter()
    try:
        with open(scratch_path, "wb") as scratch:
            def append(name: str, tensor: torch.Tensor) -> None:
                tensor = tensor.to(torch.float32).contiguous()
                if name in ranges:
                    raise ModelError(f"{gguf}: two GGUF tensors map to {name}")
                ranges[name] = TensorRange(scratch_path, name, tensor.dtype, tuple(tensor.shape), scratch.tell(),
                                           tensor.numel() * tensor.element_size())
                write_bytes(scratch, tensor)

            for i, item in enumerate(reader.tensors, 1):
                result = processor.process(weights=dequantize(item.data, item.tensor_type), name=item.name,
                                           tensor_key_mapping=names, parsed_parameters=parsed)
                if result.name in names:
                    append(names[result.name], torch.from_numpy(np.copy(result.weights)))
                for name, tensor in parsed["tensors"].items():
                    append(name, tensor)
                parsed["tensors"].clear()
                now = time.perf_counter()
                if now - last >= 5.0:
                    last = now
                    progress(f"converting {gguf.name}: {i}/{total} tensors, {scratch.tell() / 1e9:.2f} GB written")
        expected = set(skeleton.state_dict())
        if config.get_text_config().tie_word_embeddings or getattr(config, "tie_word_embeddings", False):
            expected -= {k for k in expected if k.startswith("lm_head.")}
        missing = sorted(expected - set(ranges))
        if missing:
            raise ModelError(f"{gguf}: the GGUF holds no tensor for {len(missing)} of the model's weights, e.g. {missing[0]}")
        with SafetensorsWriter(out / "model.safetensors", {n: (r.dtype, r.shape) for n, r in ranges.items()},
                               {"format": "pt"}) as writer:
            for name in writer.names:
                writer.write(name, ranges[name])
    finally:
        scratch_path.unlink(missing_ok=True)
    log.info("converted %d GGUF tensors in %.1f s", total, time.perf_counter() - start)
    config.dtype = torch.float32
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    try:
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False).save_pretrained(str(out))
    except Exception as e:  # a model without a usable tokenizer still exports, taking token ids
        log.warning("%s: no usable tokenizer (%s)", gguf, e)

