"""Real-vLLM tier helper: turn the shipped SmolLM2 GGUF into an HF safetensors folder vLLM serves.

Run with the vLLM environment's Python (it has torch, transformers and gguf):
`python gguf_to_hf.py GGUF OUT_DIR [--scale-layer N --scale F]`. The optional scaling writes a
deliberately different copy of the weights, used to check that a weight push changes the outputs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def convert(gguf: Path, out: Path, scale_layer: int | None, scale: float) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    # Tied embeddings: lm_head shares embed_tokens, and vLLM expects no separate lm_head tensor.
    state.pop("lm_head.weight", None)
    if scale_layer is not None:
        key = f"model.layers.{scale_layer}.mlp.down_proj.weight"
        state[key] = (state[key].float() * scale).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop(
        "quantization_config", None
    )  # a GGUF-loaded config claims quantization it no longer has
    cfg["architectures"] = [type(model).__name__]  # unset after a GGUF load; vLLM needs it
    cfg["torch_dtype"] = "bfloat16"
    cfg["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--scale-layer", type=int, default=None)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    convert(args.gguf, args.out, args.scale_layer, args.scale)


if __name__ == "__main__":
    main()
