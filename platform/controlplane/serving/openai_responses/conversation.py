"""A turn's prompt: its input items (and ``instructions``) rendered with the model's chat template
exactly as ``/v1/chat/completions`` renders messages, after the conversation it continues.

A turn that names ``previous_response_id`` continues that stored response's conversation. Its prompt
is the previous turn's prompt ids and generated ids exactly as the worker saw them (the KV the cache
holds), followed by what the template puts after the previous answer (the end of the assistant's
turn, the new messages, the generation prompt). That tail is found by rendering the whole
conversation and checking that it starts with the previous prompt and the previous answer's text as
the template renders them; a template that rewrites earlier turns (or different ``instructions``,
which OpenAI does not carry over) fails that check, and the turn is rendered whole instead (its
cached prefix then ends where the renderings differ). Generated ids that would not re-tokenize to the
same ids (a byte split inside a character, a merge across a boundary) are kept as generated: the
prompt extends the previous turn's KV, not a re-tokenization of its text.

Everything here is CPU work without the database: it runs in the render pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachecore.model.template_guard import RenderBudget
from controlplane.serving import bounds, intake
from controlplane.serving.model_facts import ModelFacts
from controlplane.serving.openai_responses.schemas import InputItem, ResponseCreate

ROLE = {"developer": "system"}  # the chat templates know system, user and assistant


@dataclass(frozen=True)
class Turn:
    """``tokens``: the prompt sent to the worker. ``messages``: the conversation without instructions,
    this turn's input included (a later turn appends the answer and its own input). ``reused``: prompt
    tokens taken as they were from the previous turn (0 when rendered whole)."""

    tokens: list[int]
    messages: list[dict]
    reused: int


def message_of(item: InputItem) -> dict:
    return {"role": ROLE.get(item.role, item.role), "content": item.text()}


def check_bounds(data: dict, prompt: bounds.PromptBounds) -> None:
    """The input's and instructions' characters and item count within ``prompt`` (as a chat's
    messages are checked), before the body is validated."""
    items = data.get("input")
    messages = items if isinstance(items, list) else [{"content": items}]
    if isinstance(data.get("instructions"), str):
        messages = [*messages, {"content": data["instructions"]}]
    bounds.check_messages({"messages": messages}, prompt)


def _head(instructions: str | None) -> list[dict]:
    return [] if instructions is None else [{"role": "system", "content": instructions}]


def build(facts: ModelFacts, body: ResponseCreate, previous: dict | None, budget: RenderBudget,
          splice: bool = True) -> Turn:
    """The prompt of ``body``'s turn after ``previous`` (a stored response's payload, or None);
    ``splice`` False: rendered whole (the previous turn's ids are another tokenizer's or template's)."""
    history = [] if previous is None else [*previous["messages"],
                                           {"role": "assistant", "content": previous["output_text"]}]
    messages = history + [message_of(item) for item in body.items()]
    head = _head(body.instructions)
    whole = intake.render_messages(facts, head + messages, budget)
    if splice and previous is not None and previous.get("instructions") == body.instructions:
        tail = _tail(facts, whole, head + previous["messages"], previous["output_text"], budget)
        if tail is not None:
            reused = [*previous["prompt_ids"], *previous["output_ids"]]
            return Turn(reused + tail, messages, len(reused))
    return Turn(whole, messages, 0)


def _tail(facts: ModelFacts, whole: list[int], before: list[dict], answer: str, budget: RenderBudget
          ) -> list[int] | None:
    """What ``whole`` holds after the previous prompt (``before`` rendered with its generation prompt)
    and the previous ``answer`` (as the template writes it: as it is, or trimmed, as many templates
    trim a message's content); None when ``whole`` does not start with them."""
    prompt = intake.render_messages(facts, before, budget)
    if whole[:len(prompt)] != prompt:
        return None
    for written in dict.fromkeys((answer, answer.strip(), answer.rstrip(), answer.lstrip())):
        said = facts.tokenizer.encode(written, add_bos=False)
        cut = len(prompt) + len(said)
        if whole[len(prompt):cut] == said:
            return whole[cut:]
    return None


def output_ids(facts: ModelFacts, generated: list[int]) -> list[int]:
    """The generated ids a later turn continues from: without a final end-of-sequence id (sampled, never
    fed to the model: the template writes the turn's end itself)."""
    ids = list(generated)
    eos = facts.tokenizer.eos_ids
    while ids and ids[-1] in eos:
        ids.pop()
    return ids
