"""How a Responses API turn's prompt continues the previous turn (``openai_responses.conversation``),
without Ray or a database: the previous prompt and generated ids kept exactly, the template's tail
after the previous answer, and a whole rendering where the template rewrites history."""

from __future__ import annotations

from cachecore.layout import KVLayout
from cachecore.model.chat_template import JinjaChatTemplate
from cachecore.model.template_guard import RenderBudget
from cachecore.model.tokenizer import ByteTokenizer, ChatTemplate
from controlplane.serving.model_facts import ModelFacts
from controlplane.serving.openai_responses import conversation
from controlplane.serving.openai_responses.schemas import ResponseCreate

TOK = ByteTokenizer()
BUDGET = RenderBudget(max_chars=100_000, seconds=5)
TRIMMING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
# drops every earlier answer, as templates that strip a model's reasoning from history do
REWRITING = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<{{ m['role'] }}>{{ m['content'] }}</>"
             "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def _facts(chat) -> ModelFacts:
    return ModelFacts(TOK, chat, TOK.vocab_size, 4096, KVLayout(num_layers=1, num_kv_heads=1, head_dim=8))


CHATML = _facts(ChatTemplate(TOK))


def _turn(facts, text, previous=None, instructions="Be brief."):
    body = ResponseCreate(model="m", input=text, instructions=instructions)
    return conversation.build(facts, body, previous, BUDGET)


def _stored(facts, text, generated, instructions="Be brief."):
    first = _turn(facts, text, instructions=instructions)
    return {"messages": first.messages, "instructions": instructions, "prompt_ids": first.tokens,
            "output_ids": generated, "output_text": TOK.decode(generated)}


def test_a_follow_up_is_the_previous_prompt_and_generated_ids_then_the_templates_tail():
    generated = [72, 105, 0xC3, 33]  # "Hi", a lone UTF-8 lead byte (decodes to U+FFFD), "!"
    before = _stored(CHATML, "Hello", generated)
    turn = _turn(CHATML, "More", before)
    reused = before["prompt_ids"] + generated
    assert turn.tokens[:len(reused)] == reused and turn.reused == len(reused)
    assert turn.tokens[len(reused):] == [TOK.im_end_id, 10, TOK.im_start_id, *b"user\nMore", TOK.im_end_id, 10,
                                         TOK.im_start_id, *b"assistant\n"]
    # rendering the conversation's text again would not give the generated ids back
    whole = CHATML.chat.render([{"role": "system", "content": "Be brief."}, *turn.messages])
    assert whole != turn.tokens and 0xC3 not in whole
    assert turn.messages == [{"role": "user", "content": "Hello"},
                             {"role": "assistant", "content": TOK.decode(generated)},
                             {"role": "user", "content": "More"}]


def test_a_template_that_trims_the_answer_still_continues_from_the_generated_ids():
    facts = _facts(JinjaChatTemplate(TOK, TRIMMING, {}))
    generated = list(b" Sure thing \n")
    before = _stored(facts, "Hello", generated)
    turn = _turn(facts, "More", before)
    assert turn.tokens == before["prompt_ids"] + generated + list(b"</>\n<user>More</>\n<assistant>")


def test_a_template_that_rewrites_history_or_new_instructions_render_the_turn_whole():
    facts = _facts(JinjaChatTemplate(TOK, REWRITING, {}))
    before = _stored(facts, "Hello", list(b"Hi"))
    turn = _turn(facts, "More", before)
    assert turn.reused == 0 and turn.tokens == list(b"<system>Be brief.</><user>Hello</><user>More</><assistant>")
    other = _turn(CHATML, "More", _stored(CHATML, "Hello", list(b"Hi")), instructions="Be verbose.")
    assert other.reused == 0 and other.tokens == CHATML.chat.render(
        [{"role": "system", "content": "Be verbose."}, *other.messages])
    spliced = conversation.build(CHATML, ResponseCreate(model="m", input="More", instructions="Be brief."),
                                 _stored(CHATML, "Hello", list(b"Hi")), BUDGET, splice=False)
    assert spliced.reused == 0


def test_the_ids_kept_for_a_follow_up_end_before_a_sampled_end_of_sequence():
    assert conversation.output_ids(CHATML, [72, 105, TOK.eos_id]) == [72, 105]
    assert conversation.output_ids(CHATML, [72, TOK.eos_id, 105]) == [72, TOK.eos_id, 105]
