"""Chat templates render within a budget (``cachecore.model.template_guard``): each attack below would
run for minutes or allocate gigabytes in a plain sandbox; here it stops at the limit it names, and the
templates real checkpoints ship still render exactly as before."""

from __future__ import annotations

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cachecore.model.chat_template import JinjaChatTemplate
from cachecore.model.template_guard import GuardedEnvironment, RenderBudget, RenderLimitExceeded, render_bounded
from cachecore.model.tokenizer import ByteTokenizer

BUDGET = RenderBudget(max_chars=100_000, max_steps=1_000_000, seconds=600)  # steps and sizes, never the clock
MESSAGES = [{"role": "user", "content": "hi"}]

ATTACKS = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    "nested loops over a list": ("{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}"
                                 "{% endfor %}", "steps"),
    "recursive macro": ("{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}", None),
    "repeat": ("{{ 'x' * 1000000000 }}", "chars"),
    "doubling through a namespace": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}", "chars"),
    "doubling through a macro": ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s|length }}"
                                 "{% endif %}{% endmacro %}{{ d('x', 60) }}", "chars"),
    "center filter": ("{{ 'x'|center(1000000000) }}", "chars"),
    "percent width": ("{{ '%999999999d' % 1 }}", "chars"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "chars"),
    "power": ("{{ 10 ** 100000000 }}", "chars"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "chars"),
    "replace": ("{% set s = 'x' * 4000 %}{{ s.replace('x', s) }}", "chars"),
    "join": ("{% set s = 'x' * 4000 %}{{ s.join([s] * 4000) }}", "chars"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_runaway_template_stops_at_the_limit_it_names(name):
    source, limit = ATTACKS[name]
    template = GuardedEnvironment().from_string(source)
    with pytest.raises((RenderLimitExceeded, RecursionError)) as info:
        render_bounded(template, {"messages": MESSAGES}, BUDGET)
    if limit is not None:
        assert info.value.limit == limit


def test_a_plain_sandbox_runs_the_loop_the_guard_stops():
    """Paired with the above: the same nested loop (shortened to stay quick) renders unguarded."""
    source = "{% for i in range(2000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}done"
    assert ImmutableSandboxedEnvironment().from_string(source).render() == "done"
    with pytest.raises(RenderLimitExceeded):
        render_bounded(GuardedEnvironment().from_string(source), {}, BUDGET)


def test_the_loop_guard_cannot_be_shadowed_by_the_template():
    source = ("{% set strata_iter = None %}{% for i in range(2000) %}{% for j in range(1000) %}{% endfor %}"
              "{% endfor %}")
    with pytest.raises(RenderLimitExceeded):
        render_bounded(GuardedEnvironment().from_string(source), {}, BUDGET)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


@pytest.mark.parametrize("source", [CHATML, LLAMA3])
def test_real_templates_render_as_a_plain_sandbox_renders_them(source):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello %d {0} 2024"}]
    context = {"messages": messages, "add_generation_prompt": True, "bos_token": "<s>"}
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source).render(**context)
    guarded = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    assert render_bounded(guarded, context, RenderBudget(max_chars=len(plain))) == plain
    with pytest.raises(RenderLimitExceeded):  # paired: one character less is over the cap
        render_bounded(guarded, context, RenderBudget(max_chars=len(plain) - 1))


def test_a_checkpoint_template_render_past_its_output_cap_is_render_limit_exceeded():
    chat = JinjaChatTemplate(ByteTokenizer(), "{% for m in messages %}{{ m.content * 5000 }}{% endfor %}", {})
    with pytest.raises(RenderLimitExceeded) as info:
        chat.render([{"role": "user", "content": "ab"}], budget=RenderBudget(max_chars=256))
    assert info.value.code == "template_output_too_large"
    assert len(chat.render([{"role": "user", "content": "ab"}], budget=RenderBudget(max_chars=10_000))) == 10_000


def test_template_errors_stay_template_errors():
    template = GuardedEnvironment().from_string("{{ raise_exception('no') }}")
    with pytest.raises(jinja2.exceptions.UndefinedError):
        render_bounded(template, {}, BUDGET)
