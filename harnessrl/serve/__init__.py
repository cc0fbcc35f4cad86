"""Embedded OpenAI-compatible JAX inference server speaking vLLM's token-id dialect.

`python -m harnessrl.serve --model smollm2`; in-process: `harnessrl.serve.app.start_server`.
"""
