"""The serving tests import their test doubles from this directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2's tokenizer and chat template, read from the GGUF of the shipped model package."""
    from harnessrl.model.formats.load import gguf_tokenizer, smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except ValueError as err:
        pytest.skip(f"needs the shipped SmolLM2 model: {err}")
    return gguf_tokenizer(path)


@pytest.fixture(scope="session")
def bounded_tokenizer():
    from fakes import CostlyByteTokenizer

    return CostlyByteTokenizer()


@pytest.fixture(scope="session")
def bounded_server(bounded_tokenizer):
    """One warm embedded server with small limits (tiny random model, byte tokenizer that costs
    about what BPE costs), shared by the limit, listener and admin tests.

    2 slots + 2 waiting sequences, n <= 4, n x max_tokens <= 3000, 3M prompt characters, 8 MiB
    bodies and 16 MiB of them in flight, 8 KiB request heads, 1 s to send a head (or pause in a
    body), 4 s to send a body, an admin token.
    """
    from fakes import ADMIN_TOKEN, bounded_model_config
    from flax import nnx

    from harnessrl.model.families.dense.decoder import Decoder
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    cfg = bounded_model_config()
    config = ServeConfig(
        model="tiny",
        port=0,
        num_slots=2,
        max_waiting=2,
        max_model_len=1024,
        prefill_buckets=(32, 256),
        decode_buckets=(128, 1024),
        max_n=4,
        max_request_tokens=3000,
        max_prompt_chars=3_000_000,
        max_body_bytes=8 << 20,
        max_header_bytes=8 << 10,
        read_timeout_s=1.0,
        max_buffered_bytes=16 << 20,
        body_timeout_s=4.0,
        admin_token=ADMIN_TOKEN,
    )
    handle = start_server(Decoder(cfg, rngs=nnx.Rngs(0)), bounded_tokenizer, config)
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def timed_bpe():
    """A real HF `tokenizers` ChatTokenizer (fakes.bpe_tokenizer) and the timer of its encoder."""
    from fakes import bpe_tokenizer

    return bpe_tokenizer()


@pytest.fixture(scope="session")
def gated_loader():
    from fakes import GatedLoader

    return GatedLoader()


@pytest.fixture(scope="session")
def plain_server(timed_bpe, gated_loader):
    """An embedded server started the way the train loop starts one: no admin token given, the
    default request limits (1 Mi prompt characters, 16 MiB bodies), a Rust BPE tokenizer. Tiny
    random model (the bounded server's), no warm-up (these tests generate nothing); its weight
    loads go through `gated_loader`."""
    from fakes import bounded_model_config
    from flax import nnx

    from harnessrl.model.families.dense.decoder import Decoder
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    config = ServeConfig(
        model="tiny",
        port=0,
        num_slots=2,
        max_model_len=1024,
        prefill_buckets=(32, 256),
        decode_buckets=(128, 1024),
        warmup=False,
    )
    model = Decoder(bounded_model_config(), rngs=nnx.Rngs(0))
    handle = start_server(model, timed_bpe[0], config, params_loader=gated_loader)
    yield handle
    handle.stop()
