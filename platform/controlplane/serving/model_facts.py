"""What the serving API needs to know about a deployment's active revision: how it tokenizes and
renders chats, and its limits.

Preset revisions: the byte tokenizer, ChatML and the preset's sizes. Checkpoint revisions: the
checkpoint's own tokenizer, chat template and ``config.json`` sizes, loaded from its directory by the
same code the worker uses (``cachecore.model.checkpoint.inspect_checkpoint``) and cached per revision
(a new revision, even of unchanged weights, is read anew: its template may have changed). A ``vllm``
deployment's checkpoint is inspected for that engine (``engine="vllm"``: config.json read generically,
so architectures Strata's engine refuses tokenize, template and bound requests the same way).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from cachecore.layout import KVLayout
from cachecore.model.config import preset
from cachecore.model.tokenizer import ByteTokenizer, ChatTemplate
from controlplane.common.errors import Unavailable
from controlplane.registry.models import ModelDeployment

BYTE_TOKENIZER = ByteTokenizer()
BYTE_CHAT = ChatTemplate(BYTE_TOKENIZER)
_FACTS_MAX = 64  # checkpoint revisions whose tokenizers this process keeps


@dataclass(frozen=True)
class ModelFacts:
    """How a deployment's active revision tokenizes, and its limits."""

    tokenizer: object  # ByteTokenizer | cachecore.model.hf_tokenizer.HFTokenizer
    chat: object  # ChatTemplate | cachecore.model.chat_template.JinjaChatTemplate
    vocab_size: int
    max_seq_len: int
    kv_layout: KVLayout  # the worker's page layout (block size 16), which bounds a KV upload's size

    @property
    def max_token_chars(self) -> int:
        """The most characters one token covers (``bounds``: a text this many times the context is too long)."""
        return self.tokenizer.max_token_chars


_facts: dict[tuple, ModelFacts] = {}
_facts_lock = threading.Lock()


def model_facts(deployment: ModelDeployment) -> ModelFacts:
    """Tokenizer, template and limits of ``deployment``'s active revision. A checkpoint directory that
    can no longer be read is 503 (the operator's files, not the request, are at fault)."""
    rev = deployment.active_revision
    if not rev.checkpoint_path:
        config = preset(deployment.preset)
        return ModelFacts(BYTE_TOKENIZER, BYTE_CHAT, config.vocab_size, config.max_seq_len, config.kv_layout())
    key = (rev.pk, rev.checkpoint_path, rev.digest, deployment.engine)
    facts = _facts.get(key)
    if facts is None:
        from django.conf import settings

        from cachecore.model.checkpoint import inspect_checkpoint
        from cachecore.model.hf_config import CheckpointError, weights_root

        try:
            with weights_root(settings.STRATA_WEIGHTS_ROOT):  # no file of it may lead outside the root
                info = inspect_checkpoint(rev.checkpoint_path, digest=False, engine=deployment.engine)
        except CheckpointError as exc:
            raise Unavailable(f"model '{deployment.name}' cannot be served: {exc}", retry_after=30) from None
        model = info.config.model
        facts = ModelFacts(info.tokenizer, info.chat, model.vocab_size, model.max_seq_len, model.kv_layout())
        facts.max_token_chars  # noqa: B018 (scans the vocabulary once, here, not on a request's path)
        with _facts_lock:
            if len(_facts) >= _FACTS_MAX:
                _facts.pop(next(iter(_facts)))
            _facts[key] = facts
    return facts
