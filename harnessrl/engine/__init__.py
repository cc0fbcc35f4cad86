"""The batched decoding engine: continuous batching over fixed KV-cache slots, sampling, hot-swap."""
