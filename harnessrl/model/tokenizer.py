"""Model stage: tokenizer and chat template, from an HF folder's tokenizer.json or GGUF metadata.

In: `tokenizer.json` + `tokenizer_config.json`, or the `tokenizer.*` keys of a GGUF file.
Out: `ChatTokenizer` (Rust `tokenizers` BPE + a sandboxed jinja2 chat template rendered the way
transformers renders it), able to save itself as HF tokenizer files. No torch involved.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# llama.cpp pre-tokenizer names → how the text is split before byte-level BPE.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")
GGUF_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>
GGUF_USER_DEFINED = 4


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON (as transformers renders).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTokenizer:
    """Byte-level BPE tokenizer plus the model's chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str | None],
        add_bos_token: bool = False,
        extra_eos_ids: tuple[int, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens  # bos_token, eos_token, unk_token, pad_token
        self.add_bos_token = add_bos_token
        self._template = compile_chat_template(chat_template) if chat_template else None
        eos_token = special_tokens.get("eos_token")
        eos = [self.token_id(eos_token)] if eos_token else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_ids]))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        found = self.tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return found

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode(text=...) needs a str, got {type(text).__name__}")
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.special_tokens.get("bos_token")
        if add_special_tokens and self.add_bos_token and bos:
            ids = [self.token_id(bos), *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        if self._template is None:
            raise ValueError(
                "this tokenizer has no chat template; pass one or load a model that has it"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered conversation (the template writes any special tokens itself)."""
        text = self.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode(text, add_special_tokens=False)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> ChatTokenizer:
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(
                f"{str(folder)!r} has no tokenizer.json (slow tokenizers are not supported)"
            )
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        gen = _read_json(folder / "generation_config.json").get("eos_token_id")
        extra = tuple(gen) if isinstance(gen, list) else (() if gen is None else (int(gen),))
        return cls(tok, template, special, bool(config.get("add_bos_token", False)), extra)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> ChatTokenizer:
        """Rebuild the byte-level BPE tokenizer llama.cpp describes in `tokenizer.ggml.*`."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2')"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        tok = Tokenizer(bpe)
        pre = meta.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGIT_SPLIT_PRE:  # trained with every digit its own pre-token
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in ("qwen2", "deepseek-r1-qwen"):
            tok.normalizer = normalizers.NFC()
            split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        types = list(meta.get("tokenizer.ggml.token_type") or [])
        tok.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, k in zip(tokens, types, strict=False)
                if k == GGUF_CONTROL
            ]
        )
        tok.add_tokens(
            [
                AddedToken(t, normalized=False, special=False)
                for t, k in zip(tokens, types, strict=False)
                if k == GGUF_USER_DEFINED
            ]
        )

        def name(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return None if index is None else tokens[int(index)]

        special = {
            "bos_token": name("bos_token_id"),
            "eos_token": name("eos_token_id"),
            "unk_token": name("unknown_token_id"),
            "pad_token": name("padding_token_id"),
        }
        return cls(
            tok,
            meta.get("tokenizer.chat_template"),
            special,
            bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    def save(self, out_dir: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (HF layout)."""
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(folder / "tokenizer.json"))
        special = {k: v for k, v in self.special_tokens.items() if v is not None}
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
            **special,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False)
        )
        (folder / "special_tokens_map.json").write_text(
            json.dumps(special, indent=2, ensure_ascii=False)
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older tokenizer_config files
        return value.get("content")
    return value
