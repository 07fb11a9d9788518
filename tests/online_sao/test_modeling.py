"""Loading and compiling models: ``compile_body`` gives the eager model's losses, gradients and
steps, keeps its parameter names, and the learner compiles its models when ``trainer.compile``
asks."""

from __future__ import annotations

import copy

import pytest
import torch

from online_sao.algorithms import build_algorithm, build_critic, build_optimizers
from online_sao.config import AlgorithmConfig
from online_sao.modeling import compile_body, is_compiled
from tests.online_sao.test_packing import qwen2, ragged_batch, sao_losses

COMPILED_ATOL, COMPILED_RTOL = 1e-5, 1e-4
"""Float32: the compiled body fuses element-wise operations and sums in another order; observed
differences are about 1e-7 (values, log-probs, losses) and 1e-6 relative (gradients)."""

BATCHES = ([3, 17, 6, 11, 4, 9, 2, 15], [12, 10, 4], [5])
"""Ragged batches of other row counts and lengths (one of a single rollout): one dynamic graph
must serve them all."""


def test_a_compiled_body_gives_the_eager_losses_and_gradients():
    cfg = AlgorithmConfig()
    eager_policy = qwen2(0)
    eager_critic = build_critic(cfg, eager_policy)
    with torch.no_grad():  # a non-zero head, so values (and their gradients) are not trivially 0
        eager_critic.head.weight.normal_(0, 0.5)
    policy, critic = copy.deepcopy(eager_policy), copy.deepcopy(eager_critic)
    assert compile_body(policy) is policy.model and compile_body(critic) is critic.backbone
    assert is_compiled(policy) and is_compiled(critic) and not is_compiled(eager_policy)
    for lengths in BATCHES:
        batch = ragged_batch(eager_policy, lengths)
        outputs = {}
        for name, (p, c) in {"eager": (eager_policy, eager_critic), "compiled": (policy, critic)}.items():
            values, logprobs, critic_loss, policy_loss = sao_losses(p, c, batch, True, cfg)
            (critic_loss + policy_loss).backward()
            grads = [param.grad.clone() for param in [*p.parameters(), *c.parameters()] if param.grad is not None]
            p.zero_grad(set_to_none=True)
            c.zero_grad(set_to_none=True)
            outputs[name] = (values.detach(), logprobs.detach(), critic_loss.detach(), policy_loss.detach(), grads)
        eager, compiled = outputs["eager"], outputs["compiled"]
        assert len(eager[4]) == len(compiled[4]) > 0
        for want, got in zip([*eager[:4], *eager[4]], [*compiled[:4], *compiled[4]]):
            torch.testing.assert_close(got, want, atol=COMPILED_ATOL, rtol=COMPILED_RTOL)


def test_a_compiled_learner_takes_the_eager_steps_and_keeps_its_parameter_names():
    cfg = AlgorithmConfig()

    def learner(compiled: bool):
        policy = qwen2(1)
        critic = build_critic(cfg, policy)
        if compiled:
            compile_body(policy)
            compile_body(critic)
        opts = build_optimizers(cfg, policy, critic)
        return policy, critic, build_algorithm(cfg, policy, critic, opts.policy, opts.critic, opts.critic_scheduler)

    (eager_policy, eager_critic, eager), (policy, critic, compiled) = learner(False), learner(True)
    assert list(policy.state_dict()) == list(eager_policy.state_dict())
    assert list(critic.state_dict()) == list(eager_critic.state_dict())
    for lengths in BATCHES:
        batch = ragged_batch(eager_policy, lengths, seed=len(lengths))
        want, got = eager.step(batch), compiled.step(copy.deepcopy(batch))
        assert got["skipped_nonfinite"] == want["skipped_nonfinite"] == 0.0
        for name in ("policy_loss", "value_loss", "critic_fit_loss", "policy_grad_norm", "critic_grad_norm"):
            assert got[name] == pytest.approx(want[name], rel=COMPILED_RTOL, abs=COMPILED_ATOL), name
    # three AdamW steps of the same gradients (to float rounding) leave the same weights
    for want, got in zip([*eager_policy.parameters(), *eager_critic.parameters()],
                         [*policy.parameters(), *critic.parameters()]):
        torch.testing.assert_close(got, want, atol=COMPILED_ATOL, rtol=COMPILED_RTOL)


def test_a_model_directory_without_tokenizer_files_is_refused(tmp_path, tiny_model_dir):
    """AutoTokenizer made a Qwen2 tokenizer of one token for such a directory: every text encoded to []."""
    from online_sao.config import ConfigError
    from online_sao.modeling import load_tokenizer

    qwen2(0).save_pretrained(tmp_path / "weights-only")  # as an incomplete copy leaves them
    with pytest.raises(ConfigError, match="holds no usable tokenizer"):
        load_tokenizer(tmp_path / "weights-only")
    assert load_tokenizer(tiny_model_dir)("Hello world", add_special_tokens=False)["input_ids"]
    # a tokenizer of other files (a WordPiece vocab.txt) is one too
    wordpiece = tmp_path / "wordpiece"
    wordpiece.mkdir()
    (wordpiece / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\nworld\n")
    (wordpiece / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}')
    assert load_tokenizer(wordpiece)("Hello world", add_special_tokens=False)["input_ids"] == [4, 5]
