"""A request's prompt as the engine's token ids (:class:`PromptBuilder`, used by :mod:`serving.openai_serving`).

Chat messages are rendered with the tokenizer's chat template (``add_generation_prompt``) and
tokenised without extra special tokens (the template writes them). A fresh completions text prompt
gets the special tokens the tokenizer's post-processor puts before the text (the BOS that Llama- and
Mistral-family models were trained to see first), as vLLM's server does; those it appends after
the text are left off (an EOS, as ``add_eos_token=True`` or a template with an EOS after ``$A`` adds):
they would tell the model the text is over before it writes (:meth:`PromptBuilder.fresh_text_ids`;
an EOS the text itself spells stays). Token-id prompts are taken as sent. A continuation
(``parent_interaction_id``) conditions on the parent's recorded tokens plus the new observation
tokens, tokenised without special tokens (:mod:`serving.trajectories`).

A tokenizer without a chat template (most base models) serves completions only: chat requests are
answered 404 ``chat_template_missing``, as OpenAI answers a completions model on the chat route.

Chat text that spells one of the tokenizer's special tokens (``<|im_end|>``, ...) is refused (400
``special_token_in_message``, naming the message's field): the tokenizer would read it as that token, not
as text, so a message could close its turn and open others (a forged assistant or system turn) in the
prompt the policy answers and in the trajectory the learner trains on. A completions text prompt is the
client's whole prompt by design and is tokenised as sent, special tokens included.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from serving.ids import InteractionIdError, InteractionIdSigner
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, CompletionRequest
from serving.trajectories import Trajectory, TrajectoryCache, TrajectoryPrefix, chat_observation_text

log = logging.getLogger(__name__)

LEADING_PROBE_TEXT = "Hello"
"""A text every tokenizer encodes to at least one id: where its ids start in its encoding with special
tokens tells how many the post-processor puts in front of a text."""

CHAT_TEMPLATE_MISSING = "chat_template_missing"
"""The ``code`` of a chat request to a model whose tokenizer has no chat template."""

SPECIAL_TOKEN_IN_MESSAGE = "special_token_in_message"
"""The ``code`` of a chat request whose text spells one of the tokenizer's special tokens."""


def special_token_texts(tokenizer) -> list[str]:
    """The texts a tokenizer reads as its special tokens, longest first (so that a match names the whole
    token): its named special tokens and the added tokens marked special. Empty where it splits them as
    plain text (``split_special_tokens``): no text can then spell one."""
    if getattr(tokenizer, "split_special_tokens", False):
        return []
    texts = set(getattr(tokenizer, "all_special_tokens", ()))
    texts |= {added.content for added in getattr(tokenizer, "added_tokens_decoder", {}).values() if added.special}
    return sorted((text for text in texts if text), key=len, reverse=True)


def _strings(value: object) -> Iterator[str]:
    """Every string in a message as the template gets it (a dict's keys included), walked without
    recursion: a tool call's arguments may nest as deep as the JSON parser goes."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)


def canonical_tools(tools: list[dict] | None) -> str | None:
    return None if tools is None else json.dumps(tools, sort_keys=True)


@dataclass
class PromptBuilder:
    tokenizer: object
    signer: InteractionIdSigner
    trajectories: TrajectoryCache
    stop_token_ids: frozenset[int]
    model_name: str

    def __post_init__(self) -> None:
        self.chat_available = bool(getattr(self.tokenizer, "chat_template", None))
        """The tokenizer has a chat template: /v1/chat/completions can render its prompts."""
        if not self.chat_available:
            log.warning("the model's tokenizer has no chat template: /v1/chat/completions answers 404 %s; "
                        "/v1/completions works", CHAT_TEMPLATE_MISSING)
        texts = special_token_texts(self.tokenizer)
        self._special_tokens = re.compile("|".join(map(re.escape, texts))) if texts else None
        """Matches the text of any of the tokenizer's special tokens (None: it has none)."""

    def check_chat(self) -> None:
        """Refuse a chat request when there is no template to render it with."""
        if not self.chat_available:
            raise APIError(404, f"the model {self.model_name!r} has no chat template (its tokenizer defines none), "
                                "so /v1/chat/completions cannot render a conversation; use /v1/completions",
                           param="model", code=CHAT_TEMPLATE_MISSING)

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        extra = {} if tools is None else {"tools": tools}
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **extra)
        except Exception as exc:  # jinja templates raise their own errors for conversations they refuse
            raise APIError(400, f"the chat template cannot render these messages: {exc}", param="messages")

    def _special_token_in(self, value: object) -> str | None:
        """The first special token's text that a string in ``value`` spells, None if none does."""
        if self._special_tokens is None:
            return None
        for text in _strings(value):
            found = self._special_tokens.search(text)
            if found:
                return found.group()
        return None

    def _refuse_special_tokens(self, messages: list[dict], first: int, tools: list[dict] | None) -> None:
        """400 for the first of ``messages[first:]`` (or of ``tools``: the template renders them too) with text
        that spells a special token; only what is tokenised is looked at (a continuation's earlier messages
        are the parent's recorded tokens)."""
        fields = [(f"messages[{i}].{key}", value) for i, message in enumerate(messages) if i >= first
                  for key, value in message.items()]
        fields += [(f"tools[{i}]", tool) for i, tool in enumerate(tools or [])]
        for param, value in fields:
            token = self._special_token_in(value)
            if token is not None:
                raise APIError(400, f"{param} contains {token!r}, the text of one of the model's special tokens: "
                                    "the tokenizer would read it as that token, not as text, and so a message "
                                    "could end its turn and write others into the conversation; write it "
                                    "otherwise", param=param, code=SPECIAL_TOKEN_IN_MESSAGE)

    def _encode(self, text: str, special_tokens: bool = False) -> list[int]:
        # verbose=False: an over-long prompt is refused at admission (serving.max_prompt_tokens), not warned about here
        return list(self.tokenizer(text, add_special_tokens=special_tokens, verbose=False)["input_ids"])

    @cached_property
    def _leading_special_tokens(self) -> int | None:
        """How many special tokens the post-processor puts before a text (the same for every text: a
        template's place of ``$A``), read off :data:`LEADING_PROBE_TEXT`; None where that text's ids
        do not appear whole in its encoding with special tokens (no way to tell where the text sits)."""
        plain = self._encode(LEADING_PROBE_TEXT)
        special = self._encode(LEADING_PROBE_TEXT, special_tokens=True)
        starts = [k for k in range(len(special) - len(plain) + 1) if special[k:k + len(plain)] == plain]
        return starts[0] if plain and starts else None

    def fresh_text_ids(self, text: str) -> list[int]:
        """A fresh completions text prompt's ids: the text's, after the special tokens the
        post-processor puts before it and without those it appends. Where the special tokens change
        the text's own ids (no tokenizer known does) nothing tells which were appended, and the
        encoding with them stays whole."""
        special = self._encode(text, special_tokens=True)
        plain = self._encode(text)
        lead = self._leading_special_tokens
        if lead is None or special[lead:lead + len(plain)] != plain:
            return special
        return special[:lead + len(plain)]

    def _parent(self, parent_id: str, route: str) -> Trajectory:
        try:
            self.signer.verify(parent_id)
        except InteractionIdError as exc:
            raise APIError(exc.status, exc.message, param="parent_interaction_id", code=exc.code) from None
        parent = self.trajectories.get(parent_id)
        if parent is None:
            raise APIError(404, f"interaction {parent_id} is not held by this server: another replica served "
                                f"it (behind a load balancer, send the conversation's X-Session-Id header with "
                                f"every turn), this server restarted since, or it is older than the "
                                f"{self.trajectories.capacity} most recent trajectories it keeps in memory; send "
                                "the conversation without parent_interaction_id to start a new one",
                           param="parent_interaction_id", code="interaction_not_found")
        if (route == "chat") != (parent.template_messages is not None):
            raise APIError(400, f"interaction {parent_id} was not made by the {route} endpoint",
                           param="parent_interaction_id")
        return parent

    def chat(self, request: ChatCompletionRequest
             ) -> tuple[TrajectoryPrefix, list[dict], list[tuple], list[dict] | None]:
        """The prefix, the conversation as the template renders it, each message's key, and the tools
        the template rendered (the trajectory's: stored with the turn, a continuation renders them again)."""
        messages = [m.as_template_message() for m in request.messages]
        keys = [m.key() for m in request.messages]
        if request.parent_interaction_id is None:
            tools = request.active_tools()
            self._refuse_special_tokens(messages, 0, tools)
            return TrajectoryPrefix(self._encode(self._render(messages, True, tools))), messages, keys, tools
        parent = self._parent(request.parent_interaction_id, "chat")
        stored, stored_keys = list(parent.template_messages), list(parent.message_keys)
        if keys[:len(stored)] != stored_keys or len(messages) <= len(stored):
            raise APIError(400, f"messages must repeat the {len(stored)} messages of interaction "
                                f"{parent.record.interaction_id} (its reply as returned) and add new ones",
                           param="messages")
        if messages[-1]["role"] == "assistant":
            raise APIError(400, "a continued conversation must end with a user or tool message", param="messages")
        self._refuse_special_tokens(messages, len(stored), None)
        tools = self._continued_tools(request, parent)
        render = lambda msgs, gen: self._render(msgs, gen, tools)  # noqa: E731
        messages = stored + messages[len(stored):]
        last = parent.record.response_ids[-1] if parent.record.response_ids else None
        stop_text = self.tokenizer.decode([last]) if last in self.stop_token_ids else None
        observation = chat_observation_text(render, stored, messages, stop_text)
        if observation is None:
            raise APIError(400, "the chat template does not render this conversation as an extension of "
                                f"interaction {parent.record.interaction_id}", param="messages")
        return TrajectoryPrefix.continuing(parent.record, self._encode(observation)), messages, keys, tools

    def _continued_tools(self, request: ChatCompletionRequest, parent: Trajectory) -> list[dict] | None:
        """The tools a continuation renders: the trajectory's, which the request must send. With
        ``tool_choice`` ``none`` they are still rendered (they are part of the prompt the trajectory
        began with) and no call is parsed from the answer (``active_tools`` is None)."""
        listed, known = request.listed_tools(), parent.tools  # every turn stores the trajectory's tools
        if request.tool_choice == "none" and listed is not None and canonical_tools(listed) == known:
            return listed
        tools = request.active_tools()
        if canonical_tools(tools) != known:
            raise APIError(400, f"tools must be the ones of interaction {parent.record.interaction_id}: they are "
                                "part of the trajectory's prompt", param="tools")
        return tools

    def completion(self, request: CompletionRequest) -> tuple[TrajectoryPrefix, str | None]:
        """The prefix and the prompt's text (None for token ids)."""
        prompt = request.prompt
        ids: list[int] | None = None
        if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
            ids, text = list(prompt), None  # [] too: refused as the empty prompt it is (not as several)
        elif isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            text = prompt[0]
        else:
            text = prompt
        if request.parent_interaction_id is None:
            return TrajectoryPrefix(ids if ids is not None else self.fresh_text_ids(text)), text
        parent = self._parent(request.parent_interaction_id, "completions")
        if ids is not None:
            known = parent.token_ids
            if ids[:len(known)] != known or len(ids) == len(known):
                raise APIError(400, "prompt token ids must start with every token of the parent "
                                    "interaction and add new ones", param="prompt")
            observation = ids[len(known):]
        else:
            seen = parent.visible_text
            if seen is None or not text.startswith(seen) or text == seen:
                raise APIError(400, "prompt must start with the parent interaction's prompt and returned "
                                    "text and add new text", param="prompt")
            observation = self._encode(text[len(seen):])
        return TrajectoryPrefix.continuing(parent.record, observation), text
