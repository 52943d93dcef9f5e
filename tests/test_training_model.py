"""The GPT and CNN: shapes, per-example loss, causality, config checks, fingerprints."""

from __future__ import annotations

import math

import pytest
import torch

from training.model import (
    CNN,
    GPT,
    CNNConfig,
    GPTConfig,
    build_model,
    config_from_dict,
    count_parameters,
    model_fingerprint,
)

torch.set_num_threads(1)

TINY_GPT = GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=32)


def _tokens(batch: int, time: int, vocab: int = 11, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, time), generator=generator)


def test_gpt_shapes_and_per_example_loss():
    torch.manual_seed(0)
    model = build_model("gpt", TINY_GPT)
    idx, targets = _tokens(3, 16), _tokens(3, 16, seed=1)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, 11)
    _, per_example = model(idx, targets, reduction="none")
    assert per_example.shape == (3,)
    assert torch.allclose(per_example.mean(), loss)
    # Per example = mean over its tokens of the token cross-entropy.
    token_loss = torch.nn.functional.cross_entropy(logits[1], targets[1], reduction="none")
    assert torch.allclose(per_example[1], token_loss.mean())
    # GPT-2 init: near-uniform predictions, loss about ln(vocab).
    assert abs(loss.item() - math.log(11)) < 0.2
    assert model(idx)[1] is None


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = build_model("gpt", TINY_GPT).eval()
    idx = _tokens(1, 16)
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 11
    before, _ = model(idx)
    after, _ = model(changed)
    assert torch.equal(before[0, :10], after[0, :10])
    assert not torch.allclose(before[0, 10:], after[0, 10:])


def test_gpt_weight_tying_and_too_long_input():
    model = GPT(TINY_GPT)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert count_parameters(model) < sum(p.numel() for p in model.state_dict().values())
    with pytest.raises(ValueError, match="block_size"):
        model(_tokens(1, 17))


def test_cnn_shapes_uint8_equals_scaled_float_and_per_example_loss():
    torch.manual_seed(0)
    model = build_model("cnn", CNNConfig(channels_1=4, channels_2=8, hidden=16)).eval()
    images = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 3, 9])
    logits, loss = model(images, labels)
    assert logits.shape == (5, 10)
    logits_float, _ = model(images.float() / 255.0)
    assert torch.allclose(logits, logits_float, atol=1e-6)
    _, per_example = model(images, labels, reduction="none")
    assert per_example.shape == (5,)
    assert torch.allclose(per_example.mean(), loss)
    with pytest.raises(ValueError, match="28, 28"):
        model(torch.zeros(2, 32, 32))


@pytest.mark.parametrize("model_class, config", [(GPT, TINY_GPT), (CNN, CNNConfig())])
def test_bad_reduction_is_refused(model_class, config):
    model = model_class(config)
    inputs = _tokens(1, 4) if model_class is GPT else torch.zeros(1, 28, 28)
    targets = _tokens(1, 4) if model_class is GPT else torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        model(inputs, targets, reduction="sum")


def test_build_model_refuses_unknown_kind_and_wrong_config():
    with pytest.raises(ValueError, match="unknown model kind 'rnn'.*cnn, gpt"):
        build_model("rnn", TINY_GPT)
    with pytest.raises(TypeError, match="GPTConfig"):
        build_model("gpt", CNNConfig())


@pytest.mark.parametrize(
    "bad",
    [{"n_embd": 30, "n_head": 4}, {"vocab_size": 0}, {"dropout": 1.0}],
)
def test_gpt_config_checks(bad):
    values = {"vocab_size": 10} | bad
    with pytest.raises(ValueError, match="GPTConfig"):
        GPTConfig(**values)


def test_fingerprint_tracks_kind_and_every_field():
    same = GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=32)
    assert model_fingerprint("gpt", TINY_GPT) == model_fingerprint("gpt", same)
    deeper = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=32)
    assert model_fingerprint("gpt", TINY_GPT) != model_fingerprint("gpt", deeper)
    assert len(model_fingerprint("cnn", CNNConfig())) == 64
    assert config_from_dict("gpt", {"vocab_size": 11, "block_size": 16, "n_layer": 1,
                                    "n_head": 2, "n_embd": 32}) == TINY_GPT
