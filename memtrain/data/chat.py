"""Rendering examples to text and deriving their labels from that text, so masking cannot drift.

Every example is tokenized exactly once, as the whole text the model will read, with character
offsets. The trained part is a set of character spans of that text: the response of a
prompt/response pair, or each assistant turn of a conversation. A token is trained when it starts
inside a span. Nothing is concatenated from separately tokenized pieces, so ``input_ids`` and
``labels`` always have the same length and tokens merged across a boundary are never doubled.

Assistant spans come from the chat template itself: for assistant message ``i``, the text rendered
for ``messages[:i]`` with the generation prompt must be a prefix of the whole conversation (the
span starts where it ends), and so must the text rendered for ``messages[:i+1]`` (the span ends
there). A template that rewrites earlier turns depending on what follows (Qwen3 drops the
``<think>`` part of past answers) breaks that; it is reported as :class:`TemplateRewritesTurns`,
with ``data.split_turns`` as the fix (one example per assistant turn, each exact).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from memtrain import sources
from memtrain.config import DataConfig, Problem, RecipeError
from memtrain.data.formats import Message

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Used when neither the recipe nor the tokenizer gives a chat template (documented in the schema).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
Span = tuple[int, int]


class TemplateRewritesTurns(RecipeError):
    """The chat template renders a turn differently once later turns follow it."""


def resolve_chat_template(cfg: DataConfig, tok: PreTrainedTokenizerBase) -> str:
    """The Jinja chat template for this run: the recipe's, else the tokenizer's, else ChatML."""
    value = cfg.chat_template
    if value is None:
        own = getattr(tok, "chat_template", None)
        if isinstance(own, dict):
            own = own.get("default")
        if own:
            return str(own)
        log.warning("the tokenizer has no chat template; using ChatML (set `data.chat_template` "
                    "to choose another)")
        return CHATML
    if "{{" in value or "{%" in value:
        return value
    path = sources.expanded(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise RecipeError([Problem(cfg.key("chat_template"), value,
                               "is neither a Jinja template (no `{{` or `{%`) nor an existing file",
                               "give the template text, or the path of a file holding it.")])


def render(tok: PreTrainedTokenizerBase, template: str, messages: Sequence[Message],
           generation_prompt: bool) -> str:
    """The conversation as text, through the tokenizer's Jinja environment."""
    if not messages and not generation_prompt:
        return ""
    return str(tok.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                       add_generation_prompt=generation_prompt))


def assistant_spans(tok: PreTrainedTokenizerBase, template: str, messages: Sequence[Message],
                    last_only: bool = False) -> tuple[str, list[Span]]:
    """The rendered conversation and the character spans of its assistant turns.

    Args:
        last_only: only the final message's span (it must be an assistant message).

    Raises:
        TemplateRewritesTurns: a rendered prefix is not a prefix of the whole text.
    """
    full = render(tok, template, messages, False)
    spans: list[Span] = []
    indices = [len(messages) - 1] if last_only else range(len(messages))
    for i in indices:
        if messages[i]["role"] != "assistant":
            continue
        before = render(tok, template, messages[:i], True)
        through = render(tok, template, messages[: i + 1], False)
        for name, prefix in (("up to", before), ("through", through)):
            if not full.startswith(prefix):
                raise _rewrites(i, name, prefix, full)
        spans.append((len(before), len(through)))
    return full, spans


def _rewrites(i: int, name: str, prefix: str, full: str) -> TemplateRewritesTurns:
    at = next((k for k, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b),
              min(len(prefix), len(full)))
    return TemplateRewritesTurns([Problem(
        "data.chat_template", f"...{prefix[max(0, at - 30): at + 30]!r}...",
        f"the template renders the conversation {name} message {i + 1} differently from the same "
        f"messages inside the whole conversation (they differ at character {at}): it rewrites "
        "earlier turns (as Qwen3's drops `<think>` from past answers), so the assistant tokens "
        "cannot be located exactly",
        "set `data.split_turns: true` (one example per assistant turn), or use a template that "
        "renders each turn the same whatever follows.")])


def end_token_id(tok: PreTrainedTokenizerBase) -> int | None:
    """The token that ends a document: EOS, else SEP (BERT-style tokenizers have no EOS)."""
    return tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id


def encode_spans(tok: PreTrainedTokenizerBase, text: str, spans: Sequence[Span], *,
                 special_tokens: bool, close: bool, train_all: bool = False) -> dict[str, list[int]]:
    """Tokenize ``text`` once; label the tokens that start inside ``spans`` (others -100).

    Args:
        special_tokens: let the tokenizer add its special tokens (BOS, CLS/SEP); chat templates
            write their own.
        close: end with the end-of-document token (added when the tokenizer did not), trained.
        train_all: label every token except the leading special ones (``train_on_inputs``).
    """
    if not tok.is_fast:
        raise RecipeError([Problem("model.tokenizer", tok.name_or_path,
                                   "is a slow tokenizer, which gives no character offsets",
                                   "use a tokenizer with a fast (Rust) version.")])
    enc = tok(text, add_special_tokens=special_tokens, return_offsets_mapping=True,
              return_special_tokens_mask=True)
    ids, offsets, special = enc["input_ids"], enc["offset_mapping"], enc["special_tokens_mask"]
    seen_text = False
    labels: list[int] = []
    for token, (start, _), is_special in zip(ids, offsets, special, strict=True):
        if is_special and special_tokens:  # added by the tokenizer: BOS/CLS before, EOS/SEP after
            trained = seen_text and (train_all or (bool(spans) and spans[-1][1] >= len(text)))
        else:
            seen_text = True
            trained = train_all or any(a <= start < b for a, b in spans)
        labels.append(token if trained else IGNORE_INDEX)
    end = end_token_id(tok)
    if close and end is not None and (not ids or ids[-1] != end):
        ids, labels = [*ids, end], [*labels, end]
    return {"input_ids": list(ids), "labels": labels}


def pair_example(tok: PreTrainedTokenizerBase, prompt: str, response: str,
                 train_all: bool) -> dict[str, list[int]]:
    """A prompt/response example: loss on the response and the closing token."""
    text = prompt + response
    return encode_spans(tok, text, [(len(prompt), len(text))], special_tokens=True, close=True,
                        train_all=train_all)


def chat_examples(tok: PreTrainedTokenizerBase, template: str, messages: Sequence[Message],
                  split_turns: bool, train_all: bool) -> list[dict[str, list[int]]]:
    """A conversation as one example (or one per assistant turn with ``split_turns``)."""
    if not split_turns:
        text, spans = assistant_spans(tok, template, messages)
        return [encode_spans(tok, text, spans, special_tokens=False, close=False,
                             train_all=train_all)]
    out = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            text, spans = assistant_spans(tok, template, messages[: i + 1], last_only=True)
            out.append(encode_spans(tok, text, spans, special_tokens=False, close=False,
                                    train_all=train_all))
    return out
