"""Quantization: the schemes (one table, schemes.py), how a model's linears
and embeddings are quantized (quantize.py), and the GGUF formats kept as
they are (gguf_codes.py)."""
