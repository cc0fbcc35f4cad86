"""Model stage, checkpoint formats: HF safetensors and GGUF in, HF safetensors out, model specs."""
