"""``HybridLM``: token embedding, pre-norm blocks (mixer + MLP), tied output head.

tokens ``[B, T]`` ─embed─▶ h ``[B, T, d]`` ─(h += mixer(norm(h)); h += mlp(norm(h))) × n_layers
─norm─▶ logits ``[B, T, vocab]`` (head tied to the embedding).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrences.checks import check_tensor

from .config import HybridConfig
from .mixers import build_mixer


class SwiGLU(nn.Module):
    """``[B, T, d] -> [B, T, d]``: ``down(silu(gate(x)) * up(x))``; hidden = ``mlp_ratio * d * 2/3``
    rounded up to a multiple of 16 (same parameter count as a ``mlp_ratio`` GELU MLP)."""

    def __init__(self, d: int, ratio: float):
        super().__init__()
        hidden = 16 * math.ceil(ratio * d * 2 / 3 / 16)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, mixer_name: str, config: HybridConfig):
        super().__init__()
        self.mixer_name = mixer_name
        self.norm1 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mixer = build_mixer(mixer_name, config)
        self.norm2 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = SwiGLU(config.d_model, config.mlp_ratio)

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.mixer(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class HybridLM(nn.Module):
    """A decoder-only LM whose layers mix sequence with the mixers of ``config.pattern``.

    ``forward(tokens [B, T] int64) -> logits [B, T, vocab_size]`` (fp32 under autocast too).
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(name, config) for name in config.mixers)
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) linears and embedding; residual-branch outputs scaled by
        ``1/sqrt(2 n_layers)``; norms to one; per-layer parameters (``beta``) keep their own init."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.embed.weight, std=std)
        for block in self.blocks:
            for name, mod in block.named_modules():
                if isinstance(mod, nn.Linear):
                    last = name.endswith("o_proj") or name.endswith("down")
                    nn.init.normal_(mod.weight, std=out_std if last else std)
                    if mod.bias is not None:
                        nn.init.zeros_(mod.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        check_tensor("tokens", tokens, 2)
        if tokens.dtype != torch.int64:
            raise TypeError(f"tokens must be int64 token ids, got {tokens.dtype}")
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return F.linear(self.norm(h), self.embed.weight).float()

    def set_overrides(self, **overrides) -> dict:
        """Test-time overrides of mixer attributes, e.g. ``max_centroids=8192`` for every OVQ
        layer. Returns the previous values (pass them back to restore). An override that no
        mixer has is refused."""
        previous = {}
        for key, value in overrides.items():
            mixers = [b.mixer for b in self.blocks if hasattr(b.mixer, key)]
            if not mixers:
                raise ValueError(f"override {key}={value!r}: no mixer of pattern "
                                 f"{self.config.pattern!r} has an attribute {key!r}")
            previous[key] = getattr(mixers[0], key)
            for m in mixers:
                setattr(m, key, value)
        return previous

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
