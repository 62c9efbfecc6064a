"""Byte-level tokenizer and ChatML-style chat template, each with a digest for the cache namespace.

Ids 0..255 are the UTF-8 bytes; specials follow. Text never encodes to a special id (the literal
string ``"<|im_start|>"`` in a user message is 12 byte tokens), so a tenant cannot forge chat
structure through content.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from cachecore.errors import InvalidPrompt

TOKENIZER_NAME = "strata-bytes"
TOKENIZER_VERSION = 1
SPECIALS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")

ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})


def _sha256_json(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus the specials ``SPECIALS`` at ids 256, 257, ...

    ``encode`` never yields special ids except the leading BOS; ``decode`` skips specials and replaces
    invalid UTF-8. Ids outside ``0..vocab_size-1`` raise ``InvalidPrompt``.
    """

    name = TOKENIZER_NAME
    version = TOKENIZER_VERSION
    specials = SPECIALS

    bos_id = 256
    eos_id = 257
    im_start_id = 258
    im_end_id = 259
    vocab_size = 256 + len(SPECIALS)

    # Ids generation may sample: printable ASCII, newline and EOS. Any sequence of them decodes to
    # text that re-encodes to exactly the same ids (and survives JSON), so a completion fed back as a
    # prompt hits the cache. The sampler masks logits to this set.
    GENERATABLE_IDS: tuple[int, ...] = (10, *range(32, 127), eos_id)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidPrompt(f"text must be a str, got {type(text).__name__}")
        try:
            ids = list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:  # lone surrogates (e.g. "\ud800" from JSON) are not text
            raise InvalidPrompt(f"text is not valid Unicode at position {exc.start}") from None
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise InvalidPrompt(f"token id {i!r} outside the vocabulary (0..{self.vocab_size - 1})")
            if i < 256:
                out.append(i)
        return out.decode("utf-8", errors="replace")

    def generatable_ids(self) -> tuple[int, ...]:
        """The ids generation may sample from (see ``GENERATABLE_IDS``)."""
        return self.GENERATABLE_IDS

    @property
    def max_token_chars(self) -> int:
        """The most characters one token of ``encode`` covers: each character is at least one byte token,
        so a text of n characters is at least n tokens (the serving API's bound before tokenizing)."""
        return 1

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation (a checkpoint's generation config may name several)."""
        return frozenset({self.eos_id})

    def canonical(self) -> dict[str, object]:
        return {
            "name": self.name,
            "version": self.version,
            "special_base": 256,
            "specials": list(self.specials),
        }

    @property
    def digest(self) -> str:
        """sha256 hex of the canonical description (name, version, specials and their ids)."""
        return _sha256_json(self.canonical())


class ChatTemplate:
    """ChatML rendering: ``BOS`` then per message ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then
    ``<|im_start|>assistant\\n`` when ``add_generation_prompt``.

    Messages are mappings with ``role`` in ``ROLES`` and ``content`` a str or a list of OpenAI text
    parts (``{"type": "text", "text": ...}``, joined); other keys are ignored. Anything else raises
    ``InvalidPrompt``. Generation ends at EOS (the only special the sampler may emit).
    """

    name = "chatml"
    version = 1

    def __init__(self, tokenizer: ByteTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or ByteTokenizer()

    def render(
        self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True, budget=None
    ) -> list[int]:
        """``budget`` (a ``template_guard.RenderBudget``): its ``max_chars`` caps the rendered ids (one
        byte each), checked before each message is encoded; ChatML's work is linear, so no step count."""
        tok = self.tokenizer
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidPrompt("messages must be a non-empty list")
        ids = [tok.bos_id]
        for i, message in enumerate(messages):
            role, content = self._check(i, message)
            if budget is not None and len(ids) + len(content) > budget.max_chars:
                from cachecore.model.template_guard import RenderLimitExceeded

                raise RenderLimitExceeded(f"the rendered chat is over the limit of {budget.max_chars} characters",
                                          "chars")
            ids += [tok.im_start_id, *tok.encode(f"{role}\n{content}", add_bos=False), tok.im_end_id, 10]
        if add_generation_prompt:
            ids += [tok.im_start_id, *tok.encode("assistant\n", add_bos=False)]
        return ids

    @staticmethod
    def _check(i: int, message: object) -> tuple[str, str]:
        if not isinstance(message, Mapping):
            raise InvalidPrompt(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidPrompt(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise InvalidPrompt(
                        f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise InvalidPrompt(f"messages[{i}].content must be a string, got {type(content).__name__}")
        return role, content  # type: ignore[return-value]

    @property
    def digest(self) -> str:
        """sha256 hex over the template's name/version/format and the tokenizer digest."""
        return _sha256_json(
            {
                "name": self.name,
                "version": self.version,
                "format": "<|im_start|>{role}\\n{content}<|im_end|>\\n",
                "generation_prompt": "<|im_start|>assistant\\n",
                "tokenizer": self.tokenizer.digest,
            }
        )
