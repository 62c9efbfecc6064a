"""Generator: serves completions from the reference model through the paged prefix cache.

``stream`` yields events as they happen: one ``Prefilled`` (after the prefix hit is known and the rest
of the prompt is computed), one ``TokenOut`` per generated token, then ``Finished``. The KV of the
prompt is registered right after prefill (so concurrent requests can share it) and the KV of generated
tokens at the end, so the next turn of a chat reuses the previous answer.

Model forwards are serialised (no batching yet) and handed out fairly among tenants by
``FairTurns``; a prompt's prefill runs in chunks of ``prefill_chunk`` tokens, one turn each, so a light
request waits about one chunk behind a heavy tenant, not its whole prompt. Bookkeeping is the engine's
and is thread-safe, so concurrent streams interleave token by token. ``should_abort`` is polled
between chunks and tokens: a cancelled or aborted request stops computing at once and releases its
blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from cachecore.engine import CachedSequence, CacheEngine
from cachecore.errors import InvalidPrompt, PromptTooLong
from cachecore.namespace import Namespace
from cachecore.turns import FairTurns

DEFAULT_PREFILL_CHUNK = 256


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None
    logprobs: int | None = None  # number of top alternatives to report (0 = chosen token only)
    stop_at_eos: bool = True


@dataclass(frozen=True)
class Prefilled:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose prefill was skipped
    prefill_seconds: float


@dataclass(frozen=True)
class TokenOut:
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" | "length" | "aborted"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Completion:
    """A whole (non-streamed) completion."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_seconds: float = 0.0


Event = Prefilled | TokenOut | Finished


class Generator:
    """Owns nothing but references: the model (weights), the engine (cache) and the tokenizer."""

    def __init__(
        self, model, engine: CacheEngine, tokenizer, *, model_name: str, revision: str,
        turns: FairTurns | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.revision = revision
        self.config = model.config
        # Shared by every Generator on one device (revisions being rolled out included).
        self.turns = turns or FairTurns()
        self.prefill_chunk = prefill_chunk
        allowed = torch.full((self.config.vocab_size,), float("-inf"))
        allowed[list(tokenizer.generatable_ids())] = 0.0
        self._allowed = allowed.to(engine.pages.device)

    # ------------------------------------------------------------------ validation
    def validate(self, tokens: Sequence[int], max_tokens: int = 0) -> list[int]:
        """Typed errors for bad prompts; returns the tokens as a plain list of ints."""
        if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
            raise InvalidPrompt("prompt must be a list of token ids")
        if len(tokens) == 0:
            raise InvalidPrompt("prompt is empty")
        vocab = self.config.vocab_size
        out = []
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidPrompt(f"token ids must be integers, got {type(t).__name__}")
            if not 0 <= t < vocab:
                raise InvalidPrompt(f"token id {t} is outside the vocabulary [0, {vocab})")
            out.append(t)
        limit = self.config.max_seq_len
        if len(out) + max_tokens > limit:
            raise PromptTooLong(
                f"prompt of {len(out)} tokens plus max_tokens={max_tokens} exceeds the context length {limit}"
            )
        return out

    # ------------------------------------------------------------------ generation
    def _forward(self, seq: CachedSequence, start: int, end: int | None = None) -> torch.Tensor:
        """One turn: compute ``seq.tokens[start:end]`` (KV into the pages), return the last logits."""
        end = len(seq.tokens) if end is None else end
        device = self.engine.pages.device
        chunk = torch.tensor(seq.tokens[start:end], dtype=torch.long, device=device)
        table = torch.tensor(seq.block_table, dtype=torch.long, device=device)
        with self.turns.turn(seq.tag.owner):
            logits = self.model.forward(chunk, start, table, self.engine.pages)[-1]
        self.engine.mark_computed(seq, end)
        return logits

    def _prefill(self, seq: CachedSequence, should_abort: Callable[[], bool] | None) -> torch.Tensor | None:
        """Prefill after the cached prefix in chunks; None if aborted between chunks."""
        start, end = seq.num_cached_tokens, len(seq.tokens)
        logits = None
        while start < end:
            if logits is not None and should_abort is not None and should_abort():
                return None
            stop = min(end, start + self.prefill_chunk)
            logits = self._forward(seq, start, stop)
            start = stop
        return logits

    def prefill_logits(self, ns: Namespace, tokens: Sequence[int], *, owner: str, request_salt: bytes = b"",
                       use_cache: bool = True) -> tuple[torch.Tensor, int]:
        """Logits of the last prompt token and the cached-token count (used by exactness tests)."""
        tokens = self.validate(tokens)
        seq = self.engine.admit(ns, tokens, owner=owner, model=self.model_name, revision=self.revision,
                                request_salt=request_salt, use_cache=use_cache)
        try:
            self.engine.finish_loads(seq)
            return self._prefill(seq, None).float().cpu(), seq.num_cached_tokens
        finally:
            self.engine.release(seq)

    def stream(
        self,
        ns: Namespace,
        tokens: Sequence[int],
        *,
        owner: str,
        params: SamplingParams,
        request_salt: bytes = b"",
        use_cache: bool = True,
        persist: bool = True,
        retention_seconds: float | None = None,
        should_abort: Callable[[], bool] | None = None,
    ) -> Iterator[Event]:
        tokens = self.validate(tokens, params.max_tokens)
        seq = self.engine.admit(
            ns, tokens, owner=owner, model=self.model_name, revision=self.revision,
            request_salt=request_salt, max_new_tokens=params.max_tokens, use_cache=use_cache, persist=persist,
            retention_seconds=retention_seconds,
        )
        try:
            t0 = time.perf_counter()
            self.engine.finish_loads(seq)  # the L2 prefix was prefetched while we waited for a turn
            if should_abort is not None and should_abort():
                yield Finished("aborted", len(tokens), 0, seq.num_cached_tokens)
                return
            t_compute = time.perf_counter()
            logits = self._prefill(seq, should_abort)
            seconds = time.perf_counter() - t0
            if logits is None:
                yield Finished("aborted", len(tokens), 0, seq.num_cached_tokens)
                return
            self.engine.commit(seq)
            self.engine.record_prefill(seq, seconds=time.perf_counter() - t_compute,
                                       computed=len(tokens) - seq.num_cached_tokens)
            yield Prefilled(len(tokens), seq.num_cached_tokens, seconds)
            gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            produced, reason = 0, "length"
            while produced < params.max_tokens:
                if should_abort is not None and should_abort():
                    reason = "aborted"
                    break
                token, logprob, top = self._sample(logits, params, gen)
                produced += 1
                yield TokenOut(token, self.tokenizer.decode([token]), logprob, top)
                if params.stop_at_eos and token == self.tokenizer.eos_id:
                    reason = "stop"
                    break
                if produced == params.max_tokens:
                    break
                self.engine.append_token(seq, token)
                logits = self._forward(seq, len(seq.tokens) - 1)
            yield Finished(reason, len(tokens), produced, seq.num_cached_tokens)
        finally:
            self.engine.release(seq)

    def complete(self, ns: Namespace, tokens: Sequence[int], **kwargs) -> Completion:
        out = Completion()
        for ev in self.stream(ns, tokens, **kwargs):
            if isinstance(ev, Prefilled):
                out.prompt_tokens, out.cached_tokens, out.prefill_seconds = (
                    ev.prompt_tokens, ev.cached_tokens, ev.prefill_seconds)
            elif isinstance(ev, TokenOut):
                out.token_ids.append(ev.token_id)
                if ev.logprob is not None:
                    out.logprobs.append(ev.logprob)
                if ev.top_logprobs is not None:
                    out.top_logprobs.append(ev.top_logprobs)
            else:
                out.finish_reason = ev.finish_reason
        out.text = self.tokenizer.decode(out.token_ids)
        return out

    def _sample(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None):
        masked = logits.float() + self._allowed
        if params.temperature <= 0:
            token = int(torch.argmax(masked))
        else:
            probs = torch.softmax(masked / params.temperature, dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=gen))
        if params.logprobs is None:
            return token, None, None
        logp = torch.log_softmax(masked, dim=-1)
        top = None
        if params.logprobs > 0:
            values, ids = torch.topk(logp, min(params.logprobs, 20))
            top = {self.tokenizer.decode([int(i)]): float(v) for v, i in zip(values, ids, strict=True)}
        return token, float(logp[token]), top
