"""Cheap bounds on a serving request, checked on the parsed JSON before pydantic, rendering or tokenizing.

A prompt can never be longer, in tokens, than ``PromptBounds.tokens`` (the model's context length, or
the tenant's ``max_prompt_tokens`` when smaller). Without tokenizing, that bounds:

- a token-id list: at most ``tokens`` ids;
- a string prompt: at most ``tokens * max_token_chars`` characters (each token of the model's
  tokenizer covers at most ``max_token_chars`` characters, so a longer text is certainly too long);
- a chat: at most ``tokens`` messages (each renders to at least one token) and at most
  ``tokens * max_token_chars`` characters of content in all; the rendered chat is capped at the same
  size while it renders (``cachecore.model.template_guard``).

A prompt that is certainly longer than the context is the same 400 ``context_length_exceeded`` that
the exact check after tokenizing gives; over the tenant's limit it is a 413 ``prompt_too_long``; a
chat with too many messages is a 413 ``too_many_messages``. Every message names the limit.

Bodies are bounded before they are parsed, by what the largest model the tenant may use can need:
``prompt_body_limit`` (completions and chat: the prompt's characters fully JSON-escaped, or its
token ids, plus the other fields), ``token_list_body_limit`` (KV lookup and retrieve) and
``kv_store_body_limit`` (KV uploads: a full context's token ids plus the base64 of its KV bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.common.errors import ApplicationError, TooLarge
from controlplane.serving.model_facts import ModelFacts

BODY_SLACK = 4096  # the JSON keys, the model name and the cache salt around the token ids and KV bytes


class ContextExceeded(ApplicationError):
    """A prompt certainly longer than the context: the 400 the exact check after tokenizing gives."""

    status = 400
    code = "context_length_exceeded"


@dataclass(frozen=True)
class PromptBounds:
    """The most a prompt may hold for one request: ``tokens`` (context or tenant limit, the smaller),
    ``chars`` (text that could still fit in ``tokens``), and which limit binds."""

    tokens: int
    chars: int
    context: int
    tenant_limit: int | None

    def too_long(self, size: str) -> ApplicationError:
        """The error for a prompt of ``size`` (e.g. "2000 characters") known to exceed ``tokens``."""
        if self.tenant_limit is not None and self.tenant_limit < self.context:
            return TooLarge(f"prompt of {size} is longer than this tenant's limit of {self.tenant_limit} tokens "
                            f"can hold (at most {self.chars} characters)", code="prompt_too_long")
        return ContextExceeded(f"prompt of {size} exceeds the model's context length of {self.context} tokens "
                               f"(at most {self.chars} characters)")


def prompt_bounds(facts: ModelFacts, max_prompt_tokens: int | None) -> PromptBounds:
    limit = facts.max_seq_len if max_prompt_tokens is None else min(facts.max_seq_len, max_prompt_tokens)
    limit = max(limit, 0)
    return PromptBounds(tokens=limit, chars=limit * facts.max_token_chars, context=facts.max_seq_len,
                        tenant_limit=max_prompt_tokens)


def check_prompt(data: dict, bounds: PromptBounds) -> None:
    """``/v1/completions``: a string or token-id list ``prompt`` within ``bounds`` (other types are left
    to the schema's 422)."""
    prompt = data.get("prompt")
    if isinstance(prompt, str) and len(prompt) > bounds.chars:
        raise bounds.too_long(f"{len(prompt)} characters")
    if isinstance(prompt, list) and len(prompt) > bounds.tokens:
        raise bounds.too_long(f"{len(prompt)} tokens")


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def check_messages(data: dict, bounds: PromptBounds) -> None:
    """``/v1/chat/completions``: at most ``bounds.tokens`` messages and ``bounds.chars`` characters of
    content in all."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > bounds.tokens:
        raise TooLarge(f"{len(messages)} messages are more than the {bounds.tokens} a prompt of at most "
                       f"{bounds.tokens} tokens can hold", code="too_many_messages")
    chars = 0
    for message in messages:
        if isinstance(message, dict):
            chars += _content_chars(message.get("content"))
            if chars > bounds.chars:
                raise bounds.too_long(f"more than {chars} characters of message content")


def check_token_list(tokens: object, facts: ModelFacts) -> None:
    """KV API ``tokens``: at most the context length (413), before anything iterates them."""
    if isinstance(tokens, list) and len(tokens) > facts.max_seq_len:
        raise TooLarge(f"{len(tokens)} tokens exceed the model's context length of {facts.max_seq_len}",
                       code="context_length_exceeded")


# The most JSON bytes one character of text can take ("\\ud83d\\ude00" is one character in 12 bytes),
# and what one chat message may add around its content (keys, role, name, a list of text parts).
JSON_BYTES_PER_CHAR = 12
MESSAGE_OVERHEAD = 256


def _id_bytes(facts: ModelFacts) -> int:
    return len(str(max(facts.vocab_size - 1, 0))) + 2  # digits, a comma and a space


def prompt_body_limit(facts: ModelFacts, max_prompt_tokens: int | None) -> int:
    """The largest completion or chat body a prompt within ``prompt_bounds`` can need: its text fully
    escaped, a message per token, or its token ids; plus room for the other fields."""
    prompt = prompt_bounds(facts, max_prompt_tokens)
    text = prompt.chars * JSON_BYTES_PER_CHAR + prompt.tokens * MESSAGE_OVERHEAD
    return max(text, prompt.tokens * _id_bytes(facts)) + 16 * BODY_SLACK


def token_list_body_limit(facts: ModelFacts) -> int:
    """The largest KV lookup or retrieve body: a full context of token ids."""
    return facts.max_seq_len * _id_bytes(facts) + BODY_SLACK


def kv_store_body_limit(facts: ModelFacts) -> int:
    """The largest JSON body a KV upload for this model can need: a full context of token ids (each at
    most ``len(str(vocab_size - 1))`` digits plus ", ") and the base64 of its full blocks' KV bytes
    (at 4 bytes an element)."""
    layout = facts.kv_layout
    blocks = facts.max_seq_len // layout.block_size
    # The worker may serve in another dtype than the config names (float32 on a CPU): count 4 bytes an
    # element, the widest it uses.
    elements = layout.bytes_per_block // layout.element_size
    kv_b64 = 4 * -(-blocks * elements * 4 // 3)
    return kv_b64 + token_list_body_limit(facts)
