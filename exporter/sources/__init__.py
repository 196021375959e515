"""Model sources: where an export's model comes from (a Hugging Face
folder, a model id in the local cache, a GGUF file, a built-in name), how its
weights are mapped instead of held, and which architectures are supported."""
