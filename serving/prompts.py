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
"""

from __future__ import annotations

import json
import logging
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
            raise APIError(404, f"interaction {parent_id} is not held by this server (it keeps the "
                                f"{self.trajectories.capacity} most recent trajectories in memory); "
                                "send the conversation without parent_interaction_id to start a new one",
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
            return TrajectoryPrefix(self._encode(self._render(messages, True, tools))), messages, keys, tools
        parent = self._parent(request.parent_interaction_id, "chat")
        stored, stored_keys = list(parent.template_messages), list(parent.message_keys)
        if keys[:len(stored)] != stored_keys or len(messages) <= len(stored):
            raise APIError(400, f"messages must repeat the {len(stored)} messages of interaction "
                                f"{parent.record.interaction_id} (its reply as returned) and add new ones",
                           param="messages")
        if messages[-1]["role"] == "assistant":
            raise APIError(400, "a continued conversation must end with a user or tool message", param="messages")
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
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            ids, text = list(prompt), None
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
