import pytest
import torch
from torch import nn

from online_sao.critic import ValueModel
from online_sao.losses import value_loss


def _frozen_and_trainable(critic: ValueModel):
    named = dict(critic.named_parameters())
    frozen = {n for n, p in named.items() if not p.requires_grad}
    return named, frozen


@pytest.mark.parametrize("model_fixture", ["tiny_qwen", "tiny_llama"])
def test_attention_embeddings_and_norms_frozen_mlp_and_head_train(model_fixture, request):
    policy = request.getfixturevalue(model_fixture)
    critic = ValueModel.from_policy(policy)
    named, frozen = _frozen_and_trainable(critic)
    attention = critic.attention_parameters()
    # q, k, v, o per layer (+ q/k/v biases on Qwen2), 2 layers
    assert len(attention) >= 8
    assert all(not p.requires_grad for _, p in attention)
    for name, param in named.items():
        if ".mlp." in name or name.startswith("head."):
            assert param.requires_grad, name
        else:
            assert not param.requires_grad, name  # attention, embeddings, norms
    assert any(".mlp." in n for n in named if n not in frozen)
    # the policy keeps its own, still trainable, parameters
    assert all(p.requires_grad for p in policy.parameters())
    critic_embed = critic.backbone.embed_tokens.weight
    assert critic_embed.data_ptr() != policy.base_model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(critic_embed, policy.base_model.embed_tokens.weight)


def test_unfrozen_critic_trains_everything(tiny_qwen):
    critic = ValueModel.from_policy(tiny_qwen, freeze_attention=False)
    assert all(p.requires_grad for p in critic.parameters())


@pytest.mark.parametrize("model_fixture", ["tiny_qwen", "tiny_llama"])
def test_trainable_layers_keeps_only_the_last_feed_forward_blocks(model_fixture, request):
    critic = ValueModel.from_policy(request.getfixturevalue(model_fixture), trainable_layers=1)
    trainable = sorted(n for n, p in critic.named_parameters() if p.requires_grad)
    assert trainable and all(n.startswith(("backbone.layers.1.mlp.", "head.")) for n in trainable)
    assert {"head.weight", "head.bias"} <= set(trainable)
    every_layer = ValueModel.from_policy(request.getfixturevalue(model_fixture), trainable_layers=2)
    assert {n for n, p in every_layer.named_parameters() if p.requires_grad} == \
        {n for n, p in ValueModel.from_policy(request.getfixturevalue(model_fixture)).named_parameters()
         if p.requires_grad}  # both of the fixture's two layers: the paper's critic


def test_trainable_layers_needs_frozen_attention_and_numbered_layers(tiny_qwen):
    with pytest.raises(ValueError, match="freeze_attention"):
        ValueModel.from_policy(tiny_qwen, freeze_attention=False, trainable_layers=1)

    class FlatMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="layers"):
        ValueModel(FlatMlp(), hidden_size=4, trainable_layers=1)


def test_architecture_without_feed_forward_modules_is_refused():
    class NoMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="feed-forward"):
        ValueModel(NoMlp(), hidden_size=4)


def test_value_shape_and_alignment(tiny_qwen):
    critic = ValueModel.from_policy(tiny_qwen)
    nn.init.normal_(critic.head.weight)  # the zero-initialised head would make every value 0
    ids = torch.randint(0, 64, (3, 9))
    attention = torch.ones(3, 9, dtype=torch.bool)
    values = critic(ids, attention)
    assert values.shape == (3, 9) and values.dtype == torch.float32
    assert values[:, 0].tolist() == [0.0, 0.0, 0.0]
    # the value at t is of the state before x_t: changing the last token moves no value
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    torch.testing.assert_close(critic(changed, attention), values)
    # ... while changing x_4 moves the values from position 5 on
    changed = ids.clone()
    changed[:, 4] = (changed[:, 4] + 1) % 64
    moved = critic(changed, attention)
    torch.testing.assert_close(moved[:, :5], values[:, :5])
    assert not torch.allclose(moved[:, 5:], values[:, 5:])


def test_zero_head_starts_at_zero(tiny_qwen):
    critic = ValueModel.from_policy(tiny_qwen)
    values = critic(torch.randint(0, 64, (2, 5)), torch.ones(2, 5, dtype=torch.bool))
    assert values.abs().max().item() == 0.0


def test_short_fit_to_toy_target_lowers_loss_and_leaves_attention_alone(tiny_qwen):
    torch.manual_seed(0)
    critic = ValueModel.from_policy(tiny_qwen)
    attention_before = {n: p.detach().clone() for n, p in critic.attention_parameters()}
    ids = torch.randint(0, 64, (4, 12))
    attention = torch.ones(4, 12, dtype=torch.bool)
    mask = torch.ones(4, 12, dtype=torch.bool)
    mask[:, 0] = False
    # target: +1 when the previous token id is even, -1 when odd (a function of the state before x_t)
    target = torch.zeros(4, 12)
    target[:, 1:] = 1.0 - 2.0 * (ids[:, :-1] % 2).float()
    optimizer = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss, _ = value_loss(critic(ids, attention), target, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    for name, param in critic.attention_parameters():
        assert torch.equal(param, attention_before[name]), name


def test_build_critic_passes_trainable_layers(tiny_qwen):
    from online_sao.algorithms import build_critic
    from online_sao.config import AlgorithmConfig

    critic = build_critic(AlgorithmConfig(name="sao", critic_trainable_layers=1), tiny_qwen)
    assert not any(p.requires_grad for n, p in critic.named_parameters() if n.startswith("backbone.layers.0."))


def test_config_refuses_trainable_layers_with_trained_attention():
    from pydantic import ValidationError

    from online_sao.config import AlgorithmConfig

    with pytest.raises(ValidationError, match="critic_trainable_layers needs freeze_critic_attention"):
        AlgorithmConfig(critic_trainable_layers=1, freeze_critic_attention=False)


def test_build_critic_reports_a_freeze_the_architecture_cannot_take_as_a_config_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    from online_sao.algorithms import build_critic
    from online_sao.config import AlgorithmConfig, ConfigError
    from tests.fixtures.models import make_tiny_opt

    # OPT's decoder layers hold their feed-forward projections (fc1, fc2) under no module named mlp
    with pytest.raises(ConfigError, match=r"^algorithm\.freeze_critic_attention: not possible for model type "
                                          r"'opt': no feed-forward parameters .*OPTModel"):
        build_critic(AlgorithmConfig(name="sao"), make_tiny_opt(vocab_size=64))
    # GPT-2 freezes (its feed-forward blocks are named mlp) but numbers its blocks h.<i>, not layers.<i>
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2))
    assert build_critic(AlgorithmConfig(name="ppo"), gpt2) is not None
    with pytest.raises(ConfigError, match=r"^algorithm\.critic_trainable_layers: not possible for model type "
                                          r"'gpt2': trainable_layers: no parameter sits under a 'layers\.<i>' module"):
        build_critic(AlgorithmConfig(name="ppo", critic_trainable_layers=1), gpt2)


def test_build_critic_refuses_more_trainable_layers_than_the_model_has(tiny_qwen):
    from online_sao.algorithms import build_critic
    from online_sao.config import AlgorithmConfig, ConfigError

    layers = tiny_qwen.config.num_hidden_layers
    assert build_critic(AlgorithmConfig(name="sao", critic_trainable_layers=layers), tiny_qwen) is not None
    with pytest.raises(ConfigError, match=rf"^algorithm\.critic_trainable_layers: not possible for model type "
                                          rf"'qwen2': trainable_layers {layers + 1}: the model has {layers} decoder layers"):
        build_critic(AlgorithmConfig(name="sao", critic_trainable_layers=layers + 1), tiny_qwen)
