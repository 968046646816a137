"""Masking cannot drift: labels come from the rendered conversation, checked against an oracle.

For each template style, a Python oracle builds the same text independently and knows where each
assistant turn lies. Over random conversations, :func:`memtrain.data.chat.chat_examples` must give
``input_ids`` and ``labels`` of the same length, the ids of the whole text tokenized once, and
labels on exactly the tokens that start inside assistant turns.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import MINILM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memtrain.data.chat import IGNORE_INDEX, TemplateRewritesTurns, chat_examples

Msgs = list[dict[str, str]]
Oracle = Callable[[Msgs, bool], tuple[str, list[tuple[int, int]]]]


def _chatml_block(role: str, content: str) -> tuple[str, str]:
    return f"<|im_start|>{role}\n", f"{content}<|im_end|>\n"


def _oracle(block: Callable[[str, str], tuple[str, str]], rewrite: bool = False) -> Oracle:
    """Text and assistant spans; ``block`` gives (header, body) of a message."""

    def build(messages: Msgs, last_only: bool = False) -> tuple[str, list[tuple[int, int]]]:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        text, spans = "", []
        for i, m in enumerate(messages):
            content = m["content"]
            if rewrite and m["role"] == "assistant" and i < last_user:
                content = content.split("</think>")[-1].lstrip("\n")
            header, body = block(m["role"], content)
            text += header
            if m["role"] == "assistant" and (not last_only or i == len(messages) - 1):
                spans.append((len(text), len(text) + len(body)))
            text += body
        return text, spans

    return build


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ZEPHYR = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GEMMA = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
         "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# Llama-2 style: no generation prompt, so the answer's leading space and "</s>" are the turn
LLAMA2 = ("{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>> {{ m['content'] }} <</SYS>>"
          "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
          "{% else %} {{ m['content'] }} </s>{% endif %}{% endfor %}")
# Qwen3 style: answers before the last user message lose their <think> part
QWEN3 = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
         "{% for m in messages %}{% set c = m['content'] %}"
         "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}"
         "{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
         "<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _llama2_block(role: str, content: str) -> tuple[str, str]:
    if role == "system":
        return f"<<SYS>> {content} <</SYS>>", ""
    if role == "user":
        return f"[INST] {content} [/INST]", ""
    return "", f" {content} </s>"


STYLES: dict[str, tuple[str, Oracle]] = {
    "chatml": (CHATML, _oracle(_chatml_block)),
    "zephyr": (ZEPHYR, _oracle(lambda r, c: (f"<|{r}|>\n", f"{c}</s>\n"))),
    "gemma": (GEMMA, _oracle(lambda r, c: (
        f"<start_of_turn>{'model' if r == 'assistant' else r}\n", f"{c}<end_of_turn>\n"))),
    "llama2": (LLAMA2, _oracle(_llama2_block)),
    "qwen3-rewrites": (QWEN3, _oracle(_chatml_block, rewrite=True)),
}

WORDS = st.sampled_from(["thou", "art", "good", "morrow", "sweet", "prince", "fie", "alas", "2",
                         "?", "hark", "é", "ding-dong", "o'er"])
TEXT = st.lists(WORDS, min_size=1, max_size=6).map(" ".join)
ANSWER = st.one_of(TEXT, st.tuples(TEXT, TEXT).map(lambda p: f"<think>{p[0]}</think>\n\n{p[1]}"))


@st.composite
def conversations(draw: st.DrawFn) -> Msgs:
    messages: Msgs = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXT)})
    for _ in range(draw(st.integers(1, 4))):
        messages.append({"role": "user", "content": draw(TEXT)})
        messages.append({"role": "assistant", "content": draw(ANSWER)})
    return messages


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from memtrain.sources import resolve

    return AutoTokenizer.from_pretrained(resolve(MINILM))


def _expected(tok, text: str, spans: list[tuple[int, int]], train_all: bool) -> tuple[list, list]:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if train_all or any(a <= s < b for a, b in spans) else IGNORE_INDEX
              for t, (s, _) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]
    return enc["input_ids"], labels


def _rewrites(messages: Msgs) -> bool:
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return any(m["role"] == "assistant" and "</think>" in m["content"] and i < last_user
               for i, m in enumerate(messages))


@pytest.mark.parametrize("style", list(STYLES))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), split=st.booleans(), train_all=st.booleans())
def test_exactly_the_assistant_tokens_are_trained(tok, style: str, messages: Msgs, split: bool,
                                                  train_all: bool) -> None:
    template, oracle = STYLES[style]
    if style == "qwen3-rewrites" and not split and _rewrites(messages):
        with pytest.raises(TemplateRewritesTurns, match=r"rewrites earlier turns.*split_turns"):
            chat_examples(tok, template, messages, split, train_all)
        return
    examples = chat_examples(tok, template, messages, split, train_all)
    if split:
        ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
        wanted = [oracle(messages[:end], True) for end in ends]
    else:
        wanted = [oracle(messages, False)]
    assert len(examples) == len(wanted)
    for example, (text, spans) in zip(examples, wanted, strict=True):
        assert len(example["input_ids"]) == len(example["labels"])
        ids, labels = _expected(tok, text, spans, train_all)
        assert example["input_ids"] == ids
        assert example["labels"] == labels


def test_rewriting_template_error_names_the_template_problem(tok) -> None:
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>hmm</think>\n\nhello"},
                {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "adieu"}]
    with pytest.raises(TemplateRewritesTurns) as err:
        chat_examples(tok, QWEN3, messages, split_turns=False, train_all=False)
    text = str(err.value)
    assert "`data.chat_template`" in text and "message 2" in text and "split_turns: true" in text
