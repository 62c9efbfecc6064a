"""CompletionRunner: serves completions from a model through the paged prefix cache and the scheduler.

``stream`` yields events as they happen: one ``Prefilled`` (after the prefix hit is known and the rest
of the prompt is computed), one ``TokenOut`` per generated token, then ``Finished``. The KV of the
prompt is registered as each prefill chunk lands (so concurrent requests can share it) and the KV of
generated tokens at the end, so the next turn of a chat reuses the previous answer.

Model forwards belong to the worker's ``Scheduler`` (``cachecore.scheduler``): ``stream`` submits a
request and reads its events; the loop batches it with every other running request (continuous
batching, prefill in chunks of ``prefill_chunk`` tokens, fair between tenants) through
``cachecore.model.batched.forward_batch``. ``should_abort`` is polled by the loop every step and by
the stream before each event: a cancelled or aborted request stops computing and releases its blocks
before the stream ends. Generators of several revisions may share one scheduler (one per device).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from cachecore.engine import CachedSequence, CacheEngine
from cachecore.errors import InvalidPrompt, PromptTooLong
from cachecore.model.batched import BatchItem, forward_batch
from cachecore.namespace import Namespace
from cachecore.scheduler import Failed, Finished, Logits, Prefilled, Request, Scheduler, TokenOut
from cachecore.scheduler.events import Event

DEFAULT_PREFILL_CHUNK = 256
_POLL_SECONDS = 0.05  # how often a waiting stream polls should_abort

__all__ = ["Completion", "Event", "Finished", "CompletionRunner", "Prefilled", "SamplingParams", "TokenOut"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None
    logprobs: int | None = None  # number of top alternatives to report (0 = chosen token only)
    stop_at_eos: bool = True


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



class CompletionRunner:
    """Owns nothing but references: the model (weights), the engine (cache), the tokenizer and the
    scheduler that runs its forwards (its own unless one is handed in to share)."""

    def __init__(
        self, model, engine: CacheEngine, tokenizer, *, model_name: str, revision: str,
        scheduler: Scheduler | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if scheduler is not None and scheduler.engine is not engine:
            raise ValueError("the scheduler drives another engine")
        self.model = model
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.revision = revision
        self.config = model.config
        self.scheduler = scheduler or Scheduler(engine)
        self.prefill_chunk = prefill_chunk
        allowed = torch.full((self.config.vocab_size,), float("-inf"))
        allowed[list(tokenizer.generatable_ids())] = 0.0
        self._allowed = allowed.to(engine.pages.device)
        self._allowed_cpu = allowed
        self._eos = frozenset(getattr(tokenizer, "eos_ids", None) or {tokenizer.eos_id})
        self._texts: dict[int, str] = {}  # token id -> its text (``decode_token``; decoding one id is pure)

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

    # ------------------------------------------------------------------ the scheduler's side (scheduler.request.Runner)
    def forward_items(self, items: list[tuple[CachedSequence, int, int]]) -> torch.Tensor:
        """One batched forward over ``seq.tokens[start:end]`` of each item; last logits on the CPU."""
        batch = [BatchItem(seq.tokens[start:end], start, seq.block_table) for seq, start, end in items]
        return forward_batch(self.model, self.engine.pages, batch).cpu()

    def sample(self, logits: torch.Tensor, req: Request):
        if req.generator is None and req.params.seed is not None:
            req.generator = torch.Generator().manual_seed(req.params.seed)
        return self._sample(logits, req.params, req.generator)

    def greedy_tokens(self, logits: torch.Tensor, reqs: Sequence[Request]) -> list[int | None]:
        """The greedy token of each row of ``logits`` whose request samples greedily without logprobs
        (one masked argmax over the whole batch, one ``tolist``), None for the others (``sample`` picks
        theirs). The same tokens ``sample`` picks: the same mask, ``argmax`` keeps the first maximum."""
        greedy = [r.params is not None and r.params.temperature <= 0 and r.params.logprobs is None for r in reqs]
        if not any(greedy):
            return [None] * len(reqs)
        allowed = self._allowed_cpu if logits.device.type == "cpu" else self._allowed
        picks = torch.argmax(logits.float() + allowed, dim=-1).tolist()
        return [t if g else None for t, g in zip(picks, greedy, strict=True)]

    def decode_token(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def stops(self, token: int, req: Request) -> bool:
        return req.params.stop_at_eos and token in self._eos

    # ------------------------------------------------------------------ generation
    def _request(self, ns: Namespace, tokens: list[int], *, owner: str, params: SamplingParams,
                 should_abort=None, logits_only: bool = False, **admit_kwargs) -> Request:
        admit_kwargs = {"model": self.model_name, "revision": self.revision, **admit_kwargs}
        return Request(owner=owner, runner=self, ns=ns, prompt=tokens, max_tokens=params.max_tokens,
                       admit_kwargs=admit_kwargs, chunk=self.prefill_chunk, params=params,
                       logits_only=logits_only, should_abort=should_abort)

    def prefill_logits(self, ns: Namespace, tokens: Sequence[int], *, owner: str, request_salt: bytes = b"",
                       use_cache: bool = True) -> tuple[torch.Tensor, int]:
        """Logits of the last prompt token and the cached-token count (used by exactness tests)."""
        tokens = self.validate(tokens)
        req = self._request(ns, tokens, owner=owner, params=SamplingParams(max_tokens=0), logits_only=True,
                            request_salt=request_salt, use_cache=use_cache)
        self.scheduler.submit(req)
        try:
            ev = req.events.get()
            if isinstance(ev, Failed):
                raise ev.error
            assert isinstance(ev, Logits)
            return ev.logits.float().cpu(), ev.cached_tokens
        finally:
            if not req.done.is_set():
                self.scheduler.cancel(req)

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
        """Submit to the scheduler and yield the request's events. Raises what admission raises
        (``InflightLimit``, ``OutOfBlocks`` for a request the pool can never hold) and what failed the
        request in the loop. Closing the iterator early cancels the request (blocks released before
        ``close`` returns)."""
        tokens = self.validate(tokens, params.max_tokens)
        req = self._request(ns, tokens, owner=owner, params=params, should_abort=should_abort,
                            request_salt=request_salt, use_cache=use_cache, persist=persist,
                            retention_seconds=retention_seconds)
        self.scheduler.submit(req)
        # without should_abort there is nothing to poll: block until the loop delivers (a waiting stream
        # then costs the loop thread no GIL hand-offs; 64 streams polling every 50 ms took ~1,300 a second)
        poll = _POLL_SECONDS if should_abort is not None else None
        try:
            while True:
                try:
                    ev = req.events.get(timeout=poll)
                except queue.Empty:
                    ev = None
                if isinstance(ev, Failed):
                    raise ev.error
                if should_abort is not None and not isinstance(ev, Finished) and should_abort():
                    self.scheduler.cancel(req)  # returns once its blocks are released and its KV committed
                    # what it did before it stopped (a cancelled prewarm's writes are booked)
                    yield Finished("aborted", len(tokens), req.produced, req.cached_tokens,
                                   cached_by_tier=req.cached_by_tier, load_stop=req.load_stop,
                                   write_tokens=req.write_tokens)
                    return
                if ev is None:
                    continue
                yield ev
                if isinstance(ev, Finished):
                    return
        finally:
            if not req.done.is_set():
                self.scheduler.cancel(req)

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
        masked = logits.float() + (self._allowed_cpu if logits.device.type == "cpu" else self._allowed)
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
            top = {self.decode_token(int(i)): float(v) for v, i in zip(values.tolist(), ids.tolist(), strict=True)}
        return token, float(logp[token]), top
