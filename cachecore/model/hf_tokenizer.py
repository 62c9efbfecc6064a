"""A checkpoint's own tokenizer (``tokenizer.json`` through the ``tokenizers`` library) and chat template.

``HFTokenizer`` has the interface of ``ByteTokenizer`` (``encode``, ``decode``, ``generatable_ids``,
``eos_id``, ``eos_ids``, ``bos_id``, ``vocab_size``, ``canonical``, ``digest``), so the runner, the
worker and the control plane use either without knowing which. ``load_text(path)`` is what the
worker's loader and the web process both call, so a revision is tokenized and templated the same way
on both sides.

Special tokens come from ``tokenizer_config.json`` (``bos_token``... as text or ``{"content": ...}``;
``special_tokens_map.json`` where older checkpoints keep them). EOS ids are the generation config's
(``CheckpointConfig.eos_token_ids``), else the ``eos_token``'s id. The chat template is
``chat_template.jinja`` (transformers 5) or ``tokenizer_config.json``'s ``chat_template`` (a string,
or a list of named templates: ``default`` is used).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from cachecore.errors import InvalidPrompt
from cachecore.model.chat_template import JinjaChatTemplate
from cachecore.model.hf_config import CheckpointConfig, CheckpointError, checkpoint_dir, read_config, read_json

TOKENIZER_NAME = "hf-tokenizers"
TOKENIZER_VERSION = 1
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HFTokenizer:
    """``tokenizer.json`` with the checkpoint's special tokens and EOS ids.

    ``encode(text, add_bos=True)`` adds the special tokens the tokenizer's post-processor adds (BOS
    for Llama, nothing for Qwen) when ``add_bos``, as transformers' ``encode`` does by default;
    ``decode`` skips special tokens and the model's ids the tokenizer lacks (``model_vocab_size`` above
    the tokenizer's ``vocab_size``: padded rows), as vLLM's detokenizer does. Every id of the model is
    generatable (as in transformers' ``generate`` and vLLM, which sample from all of the model's logits).
    Bad input (an id outside the model's vocabulary) raises ``InvalidPrompt``.
    """

    name = TOKENIZER_NAME
    version = TOKENIZER_VERSION

    def __init__(self, tokenizer_json: bytes, special_tokens: dict[str, str], eos_ids: Sequence[int],
                 bos_id: int | None = None, model_vocab_size: int | None = None) -> None:
        try:
            self._tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as exc:  # tokenizers raises its own Exception type for malformed files
            raise CheckpointError(f"tokenizer.json cannot be loaded: {exc}") from None
        self._sha256 = hashlib.sha256(tokenizer_json).hexdigest()
        self._max_token_chars: int | None = None
        self.special_tokens = dict(special_tokens)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.model_vocab_size = max(self.vocab_size, model_vocab_size or 0)
        ids = {name: self._tok.token_to_id(text) for name, text in self.special_tokens.items()}
        eos = tuple(eos_ids) or ((ids["eos_token"],) if ids.get("eos_token") is not None else ())
        if not eos:
            raise CheckpointError("the checkpoint names no EOS token (generation_config.json, config.json "
                                  "eos_token_id or tokenizer_config.json eos_token)")
        if any(not 0 <= i < self.vocab_size for i in eos):
            raise CheckpointError(f"EOS ids {list(eos)} are outside the tokenizer's {self.vocab_size} ids")
        self._eos_ids = frozenset(eos)
        self.eos_id = ids["eos_token"] if ids.get("eos_token") in self._eos_ids else eos[0]
        self.bos_id = ids.get("bos_token") if ids.get("bos_token") is not None else bos_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidPrompt(f"text must be a str, got {type(text).__name__}")
        try:
            return self._tok.encode(text, add_special_tokens=add_bos).ids
        except Exception as exc:  # e.g. lone surrogates, which Rust strings cannot hold
            raise InvalidPrompt(f"text cannot be tokenized: {exc}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; a padded id (the model's, not the tokenizer's) adds nothing, as in vLLM
        (``tokenizers`` drops ids it does not know; they are dropped here explicitly, so the text never
        depends on that)."""
        known = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.model_vocab_size:
                raise InvalidPrompt(f"token id {i!r} outside the vocabulary (0..{self.model_vocab_size - 1})")
            if i < self.vocab_size:
                known.append(i)
        return self._tok.decode(known, skip_special_tokens=True)

    def generatable_ids(self) -> tuple[int, ...]:
        return tuple(range(self.model_vocab_size))

    @property
    def max_token_chars(self) -> int:
        """The longest token's text in characters (added tokens included; byte-level and byte-fallback
        pieces count at least one character per byte they cover): a text of n characters is at least
        n / max_token_chars tokens, which the serving API checks before tokenizing."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    def canonical(self) -> dict[str, object]:
        return {
            "name": self.name,
            "version": self.version,
            "tokenizer_json_sha256": self._sha256,
            "special_tokens": self.special_tokens,
            "bos_id": self.bos_id,
            "eos_ids": sorted(self._eos_ids),
        }

    @property
    def digest(self) -> str:
        """sha256 hex of the canonical description (tokenizer.json bytes, specials, BOS/EOS ids)."""
        return hashlib.sha256(json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _special_tokens(root: Path, tok_cfg: dict) -> dict[str, str]:
    legacy = root / "special_tokens_map.json"
    sources = [read_json(legacy, "special_tokens_map.json")] if legacy.is_file() else []
    sources.append(tok_cfg)  # tokenizer_config.json wins
    out: dict[str, str] = {}
    for source in sources:
        for name in SPECIAL_NAMES:
            text = _token_text(source.get(name))
            if text is not None:
                out[name] = text
    return out


def _template_source(root: Path, tok_cfg: dict) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read chat_template.jinja: {exc}") from None
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise CheckpointError("tokenizer_config.json: chat_template must be a string or a list of named templates")
    return template


def load_text(path: str | os.PathLike[str], ckpt: CheckpointConfig | None = None
              ) -> tuple[HFTokenizer, JinjaChatTemplate]:
    """The checkpoint's tokenizer and chat template. ``ckpt`` (``read_config(path)`` when omitted)
    supplies the EOS and BOS ids of the config. Raises ``CheckpointError``."""
    root = checkpoint_dir(path)
    ckpt = ckpt or read_config(root)
    try:
        tokenizer_json = (root / "tokenizer.json").read_bytes()
    except OSError:
        raise CheckpointError(f"checkpoint {str(root)!r} has no readable tokenizer.json") from None
    cfg_path = root / "tokenizer_config.json"
    tok_cfg = read_json(cfg_path, "tokenizer_config.json") if cfg_path.is_file() else {}
    tokenizer = HFTokenizer(tokenizer_json, _special_tokens(root, tok_cfg), ckpt.eos_token_ids, ckpt.bos_token_id,
                            model_vocab_size=ckpt.model.vocab_size)
    if tokenizer.vocab_size > ckpt.model.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} ids but the model only "
                              f"{ckpt.model.vocab_size} (config.json vocab_size)")
    try:
        chat = JinjaChatTemplate(tokenizer, _template_source(root, tok_cfg), tokenizer.special_tokens)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return tokenizer, chat
