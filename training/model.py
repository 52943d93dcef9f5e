"""The two models the trainer knows: a char-level GPT for text and a small CNN for 28x28 images.

The GPT follows nanoGPT's model file (karpathy/nanoGPT `model.py`): pre-norm transformer blocks,
causal self-attention through `F.scaled_dot_product_attention`, tied input/output embeddings,
GPT-2 initialisation. Both models share one interface:

    logits, loss = model(inputs, targets=None, reduction="mean")

`reduction="none"` returns one loss per example (for text the mean over its tokens), so the
trainer can weight examples (curriculum weights, InfoBatch, Qin et al. ICLR'24).

A model is identified by its kind and config; `model_fingerprint` hashes them so a checkpoint
written under one config is refused under another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

_REDUCTIONS = ("mean", "none")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # nanoGPT: no bias is a bit better and faster

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be a multiple of n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")


@dataclass(frozen=True)
class CNNConfig:
    num_classes: int = 10
    channels_1: int = 16
    channels_2: int = 32
    hidden: int = 64
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_classes", "channels_1", "channels_2", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"CNNConfig.{name}={getattr(self, name)} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"CNNConfig.dropout={self.dropout} must be in [0, 1)")


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; use one of {_REDUCTIONS}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.size()
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (B, T, C) -> (B, nh, T, hs): attention runs per head.
        q, k, v = (
            t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2)
            for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.block_size, config.n_embd),
                "drop": nn.Dropout(config.dropout),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, bias=config.bias),
            }
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017), as in GPT-2 and nanoGPT.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: int64 (B, T) with T <= block_size. Loss per example is the token mean."""
        _check_reduction(reduction)
        _, time = idx.size()
        if time > self.config.block_size:
            raise ValueError(
                f"sequence length {time} exceeds block_size={self.config.block_size}; "
                "cut the inputs or build the model with a larger block_size"
            )
        positions = torch.arange(time, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        token_loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
        ).view(targets.shape)
        per_example = token_loss.mean(dim=1)
        return logits, per_example if reduction == "none" else per_example.mean()


class CNN(nn.Module):
    """Two conv-relu-pool stages and a two-layer head; input uint8 or float (B, 28, 28)."""

    # MNIST pixel mean and std on [0, 1]: the usual normalisation for this data.
    PIXEL_MEAN = 0.1307
    PIXEL_STD = 0.3081

    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        self.config = config
        self.conv_1 = nn.Conv2d(1, config.channels_1, kernel_size=3, padding=1)
        self.conv_2 = nn.Conv2d(config.channels_1, config.channels_2, kernel_size=3, padding=1)
        self.fc_1 = nn.Linear(config.channels_2 * 7 * 7, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.fc_2 = nn.Linear(config.hidden, config.num_classes)

    def forward(
        self, images: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check_reduction(reduction)
        if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28):
            raise ValueError(f"images must be (B, 28, 28), got {tuple(images.shape)}")
        x = images.float()
        if images.dtype == torch.uint8:
            x = x / 255.0
        x = ((x - self.PIXEL_MEAN) / self.PIXEL_STD).unsqueeze(1)
        x = F.max_pool2d(F.relu(self.conv_1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv_2(x)), 2)
        logits = self.fc_2(self.dropout(F.relu(self.fc_1(x.flatten(1)))))
        if targets is None:
            return logits, None
        per_example = F.cross_entropy(logits, targets, reduction="none")
        return logits, per_example if reduction == "none" else per_example.mean()


MODEL_KINDS: dict[str, tuple[type, type]] = {"gpt": (GPT, GPTConfig), "cnn": (CNN, CNNConfig)}
# Which model trains on which kind of ExampleSet.
MODEL_KIND_FOR_DATA = {"text": "gpt", "image": "cnn"}


def build_model(kind: str, config: GPTConfig | CNNConfig) -> nn.Module:
    """A fresh model of `kind` ("gpt" or "cnn"); the config must be that kind's config class."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(sorted(MODEL_KINDS))}")
    model_class, config_class = MODEL_KINDS[kind]
    if not isinstance(config, config_class):
        raise TypeError(
            f"model kind {kind!r} needs a {config_class.__name__}, got {type(config).__name__}"
        )
    return model_class(config)


def config_dict(config: GPTConfig | CNNConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_dict(kind: str, values: dict[str, Any]) -> GPTConfig | CNNConfig:
    """Rebuilds a config (e.g. from a checkpoint) for `kind`."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; known: {', '.join(sorted(MODEL_KINDS))}")
    return MODEL_KINDS[kind][1](**values)


def model_fingerprint(kind: str, config: GPTConfig | CNNConfig) -> str:
    """sha256 over the kind and the config fields (canonical JSON): equal iff same architecture."""
    canonical = json.dumps({"kind": kind, "config": config_dict(config)}, sort_keys=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
