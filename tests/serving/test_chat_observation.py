"""chat_observation_text: what a continued conversation adds after the parent's sampled reply, for
templates that render the reply verbatim (ChatML), with spaces around it (Llama 2) or trimmed."""

from __future__ import annotations

from serving.trajectories import chat_observation_text


def chatml(messages, generation_prompt):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def llama2(messages, generation_prompt):  # Llama 2's template: bos + '[INST] ' ... ' ' + reply.strip() + ' ' + eos
    text = ""
    for m in messages:
        content = m["content"].strip()
        text += f"<s>[INST] {content} [/INST]" if m["role"] == "user" else f" {content} </s>"
    return text


def trimming(messages, generation_prompt):  # Llama 3's shape: every content trimmed
    text = "".join(f"<|h|>{m['role']}<|e|>\n\n{m['content'].strip()}<|eot|>" for m in messages)
    return text + ("<|h|>assistant<|e|>\n\n" if generation_prompt else "")


STORED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello there\n"}]
NEW = STORED + [{"role": "user", "content": "and then?"}]


def test_a_verbatim_template_observes_its_closing_and_the_new_turn():
    assert chat_observation_text(chatml, STORED, NEW, "<|im_end|>") == \
        "\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_with_spaces_around_the_reply_continues():
    assert chat_observation_text(llama2, STORED, NEW, None) == " </s><s>[INST] and then? [/INST]"
    # the model ended it: the space before the template's "</s>" stands where the model's own stop token is
    # (it was observed as " </s>", a second stop token after the model's)
    assert chat_observation_text(llama2, STORED, NEW, "</s>") == "<s>[INST] and then? [/INST]"


def test_an_empty_reply_the_model_ended_continues_after_its_stop_token():
    stored = [STORED[0], {"role": "assistant", "content": ""}]  # rendered "  </s>"
    new = stored + [NEW[-1]]
    assert chat_observation_text(llama2, stored, new, "</s>") == "<s>[INST] and then? [/INST]"


def test_a_trimming_template_continues():
    assert chat_observation_text(trimming, STORED, NEW, None) == \
        "<|eot|><|h|>user<|e|>\n\nand then?<|eot|><|h|>assistant<|e|>\n\n"


def test_a_template_that_puts_text_before_the_reply_is_refused():
    def labelled(messages, generation_prompt):
        text = "".join(f"{m['role']}: " + ("Answer: " if m["role"] == "assistant" else "") + f"{m['content']}\n"
                       for m in messages)
        return text + ("assistant: " if generation_prompt else "")
    assert chat_observation_text(labelled, STORED, NEW, None) is None  # the model never saw "Answer: "


def test_a_conversation_the_template_rewrites_is_refused():
    def rewrites(messages, generation_prompt):  # history rendered differently once a turn follows
        shown = messages if len(messages) < 3 else [{**m, "content": m["content"].upper()} for m in messages]
        return chatml(shown, generation_prompt)
    assert chat_observation_text(rewrites, STORED, NEW, None) is None
