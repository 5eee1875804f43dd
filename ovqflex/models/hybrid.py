"""``HybridLM``: token embedding, pre-norm blocks (mixer + MLP), tied output head.

tokens ``[B, T]`` ─embed─▶ h ``[B, T, d]`` ─(h += mixer(norm(h)); h += mlp(norm(h))) × n_layers
─norm─▶ logits ``[B, T, vocab]`` (head tied to the embedding).

Mixers may return ``(y, aux)`` with ``aux["loss"]`` an auxiliary training loss (the VQ
commitment loss); ``forward(tokens, return_aux=True)`` returns ``(logits, aux_loss)`` with
their sum, which the trainer adds to the task loss. A mixer with ``standalone_block = True``
(the LongVQ block, which has its own gated residual, norms and FFN) is the whole block.
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
        self.mixer = build_mixer(mixer_name, config)
        self.standalone = bool(getattr(self.mixer, "standalone_block", False))
        if not self.standalone:
            self.norm1 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
            self.norm2 = nn.RMSNorm(config.d_model, eps=config.norm_eps)
            self.mlp = SwiGLU(config.d_model, config.mlp_ratio)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """-> (h, the mixer's aux loss or None)."""
        out = self.mixer(h if self.standalone else self.norm1(h))
        aux = None
        if isinstance(out, tuple):
            out, aux = out[0], out[1]["loss"]
        if self.standalone:
            return out, aux
        h = h + out
        return h + self.mlp(self.norm2(h)), aux


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

    def forward(self, tokens: Tensor, *, return_aux: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """-> logits; with ``return_aux=True`` ``(logits, aux_loss)`` (0-d fp32, the sum of the
        mixers' auxiliary losses; 0 when no mixer has one)."""
        check_tensor("tokens", tokens, 2)
        if tokens.dtype != torch.int64:
            raise TypeError(f"tokens must be int64 token ids, got {tokens.dtype}")
        h = self.embed(tokens)
        aux_loss = torch.zeros((), device=tokens.device)
        for block in self.blocks:
            h, aux = block(h)
            if aux is not None:
                aux_loss = aux_loss + aux.float()
        logits = F.linear(self.norm(h), self.embed.weight).float()
        return (logits, aux_loss) if return_aux else logits

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
