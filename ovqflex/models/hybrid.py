"""``HybridLM``: token embedding, pre-norm blocks (mixer + MLP), tied output head.

tokens ``[B, T]`` ─embed─▶ h ``[B, T, d]`` ─(h += mixer(norm(h)); h += mlp(norm(h))) × n_layers
─norm─▶ logits ``[B, T, vocab]`` (head tied to the embedding).

Mixers are :class:`~ovqflex.layers.AttentionLayer` s; ``mixer(x, return_aux=True)`` gives
``(y, aux)``, ``aux["loss"]`` an auxiliary training loss where the mixer has one (the VQ
commitment loss); ``forward(tokens, return_aux=True)`` returns ``(logits, aux_loss)`` with
their sum, which the trainer adds to the task loss. A mixer with ``standalone_block = True``
(the LongVQ block, which has its own gated residual, norms and FFN) is the whole block.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrences.checks import check_choice, check_int, check_number, check_tensor, host_check_is_free
from recurrences.compiling import graphed
from recurrences.precision import widened

from .config import HybridConfig
from .mixers import build_mixer


@dataclass
class ModelCache:
    """Decode cache of a :class:`HybridLM`: one layer cache per block, and tokens seen."""

    layers: list
    position: int

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)


DECODES = ("functional", "static", "compiled", "graph")


def static_step(step, decode: str, device: torch.device):
    """A static-cache decode ``step`` (fixed shapes, caches written in place) as ``decode`` runs it:
    ``"static"`` eager, ``"compiled"`` compiled once (``fullgraph=True, dynamic=False``), ``"graph"``
    compiled and replayed from one CUDA graph on ``device`` (:func:`recurrences.compiling.graphed`)."""
    check_choice("decode", decode, DECODES[1:])
    if decode == "static":
        return step
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    return graphed(compiled, device) if decode == "graph" else compiled


def _check_ids(name: str, tokens: Tensor, vocab_size: int) -> None:
    """ValueError naming ``name`` unless every id of ``tokens`` lies in ``[0, vocab_size)`` (reads them on the host)."""
    if tokens.numel():
        lo, hi = (int(x) for x in tokens.aminmax())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} ids must lie in [0, {vocab_size}) (the model's vocab_size), "
                             f"got ids from {lo} to {hi}")


def sample_next(logits: Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None = None) -> Tensor:
    """logits ``[B, V]`` -> next tokens ``[B, 1]`` int64: greedy at temperature 0, else a
    sample from ``softmax(logits / temperature)`` restricted to the ``top_k`` best."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature  # <= 0: a tiny temperature cannot overflow
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


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

    def forward(self, h: Tensor, cache=None, use_cache: bool = False):
        """h ``[B, T, d]`` -> ``(h, the mixer's aux loss or None)``; with a ``cache`` or ``use_cache``
        (inference) ``(h, the mixer's cache)``."""
        x = h if self.standalone else self.norm1(h)
        if cache is None and not use_cache:
            out, aux = self.mixer(x, return_aux=True)
            extra = aux.get("loss")
        else:
            if not self.mixer.supports_cache:
                raise NotImplementedError(f"mixer {self.mixer_name!r} ({type(self.mixer).__name__}) has no decode "
                                          "cache: generation and use_cache need layers with supports_cache=True")
            out, extra = self.mixer(x, cache=cache, use_cache=True)
        if not self.standalone:
            h = h + out
            out = h + self.mlp(self.norm2(h))
        return out, extra


def _undo(done: list[tuple[nn.Module, str, object]]) -> None:
    """Give each ``(mixer, key, value before)`` of ``HybridLM._override`` its value back, last first."""
    for m, key, before in reversed(done):
        setattr(m, key, before)


class HybridLM(nn.Module):
    """A decoder-only LM whose layers mix sequence with the mixers of ``config.pattern``.

    ``forward(tokens [B, T] int64) -> logits [B, T, vocab_size]`` (fp32 under autocast too; fp64 for an fp64 model).
    """

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(name, config) for name in config.mixers)
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) linears and embedding, biases zero; the residual-branch outputs of the pre-norm
        blocks (the mixer's ``o_proj``, the MLP's ``down``) scaled by ``1/sqrt(2 n_layers)``, a standalone
        post-norm block's (LongVQ, which normalises after each of its sums) not; norms to one; per-layer
        parameters (``beta``) keep their own init."""
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

    def forward(self, tokens: Tensor, cache: ModelCache | None = None, use_cache: bool = False, *,
                return_aux: bool = False):
        """tokens ``[B, T]`` int64 ids in ``[0, vocab_size)`` (checked where that is free, eager on a CPU: a
        ValueError naming the range; compiled or on an accelerator the check would stop the graph or sync the host
        at every call, and an id out of range is a device-side assert on CUDA; :meth:`generate` checks its prompt
        everywhere) -> logits ``[B, T, vocab]``; with
        ``return_aux=True`` ``(logits, aux_loss)`` (0-d fp32, the sum of the mixers' auxiliary losses; 0 when no
        mixer has one); with ``use_cache=True`` or a ``cache`` (:class:`ModelCache`, inference)
        ``(logits, cache)``."""
        check_tensor("tokens", tokens, 2)
        if tokens.dtype != torch.int64:
            raise TypeError(f"tokens must be int64 token ids, got {tokens.dtype}")
        if host_check_is_free(tokens):
            _check_ids("tokens", tokens, self.config.vocab_size)
        if cache is not None and not isinstance(cache, ModelCache):
            raise TypeError(f"cache must be a ModelCache (from forward(..., use_cache=True)), got {type(cache).__name__}")
        h = self.embed(tokens)
        if cache is None and not use_cache:
            aux_loss = torch.zeros((), device=tokens.device)
            for block in self.blocks:
                h, aux = block(h)
                if aux is not None:
                    aux_loss = aux_loss + aux.float()
            logits = widened(F.linear(self.norm(h), self.embed.weight))
            return (logits, aux_loss) if return_aux else logits
        if return_aux:
            raise ValueError("return_aux is for training forwards; a cached (inference) forward has no aux loss")
        logits, layers = self._cached(h, [None] * len(self.blocks) if cache is None else cache.layers)
        return logits, ModelCache(layers, (0 if cache is None else cache.position) + tokens.shape[1])

    def _cached(self, h: Tensor, layer_caches: list) -> tuple[Tensor, list]:
        """Embedded tokens h ``[B, T, d]`` through every block with its cache (None: a prefill)
        -> logits ``[B, T, vocab]`` fp32 and the blocks' caches after them."""
        layers = []
        for block, layer_cache in zip(self.blocks, layer_caches):
            h, layer_cache = block(h, layer_cache, use_cache=True)
            layers.append(layer_cache)
        return widened(F.linear(self.norm(h), self.embed.weight)), layers

    def static_caches(self, cache: ModelCache, capacity: int) -> list:
        """The in-place caches continuing ``cache`` (a prefill's, not changed), one per block, for
        sequences of at most ``capacity`` tokens (docs/design.md §6, "Static decode"); a mixer
        without a static cache is refused by name."""
        if not isinstance(cache, ModelCache):
            raise TypeError(f"cache must be a ModelCache (from forward(..., use_cache=True)), got "
                            f"{type(cache).__name__}")
        for block in self.blocks:
            if block.mixer.static_cache_type is None:
                raise NotImplementedError(f"mixer {block.mixer_name!r} ({type(block.mixer).__name__}) has no static "
                                          "(in-place) decode cache: use decode='functional'")
        return [block.mixer.static_cache(c, capacity) for block, c in zip(self.blocks, cache.layers)]

    def decode_static(self, tokens: Tensor, caches: list) -> Tensor:
        """One token per sequence, tokens ``[B, 1]`` int64, through the static ``caches`` (written in
        place) -> logits ``[B, 1, vocab]`` fp32: fixed shapes, no host sync, the function to compile
        (``torch.compile(fullgraph=True, dynamic=False)``: one graph for every step). After it the
        caller calls :meth:`static_boundary` with the new position."""
        return self._cached(self.embed(tokens), caches)[0]

    def static_boundary(self, caches: list, position: int, *, compile: bool = False) -> None:
        """The host-side work after a :meth:`decode_static` step that left ``position`` tokens
        (OVQ: route and absorb a completed chunk, KVM: the oldest window chunk; ``compile``: their
        compiled routing steps)."""
        for block, cache in zip(self.blocks, caches):
            block.mixer.static_boundary(cache, position, compile=compile)

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, decode: str = "functional") -> Tensor:
        """Continue ``prompt [B, T]`` int64 by ``max_new_tokens`` sampled tokens -> ``[B, T + max_new_tokens]``.

        One prefill over the prompt, then one token per step through the layers' decode
        caches (memory bounded by the caches, not the context). ``temperature=0`` is greedy;
        ``top_k`` keeps the k most likely tokens before sampling. ``decode``: ``"functional"``
        (the caches of ``forward(..., cache=)``), ``"static"`` (the fast path: in-place caches
        allocated once after the prefill, :meth:`decode_static`; every mixer must have one) or
        ``"compiled"`` (the static step compiled once, ``fullgraph=True, dynamic=False``) or
        ``"graph"`` (CUDA only: the compiled step captured in one CUDA graph and replayed, so a step
        costs one launch; :func:`recurrences.compiling.graphed`). The tokens are the same up to float
        rounding (docs/design.md §6, "Static decode").
        """
        check_choice("decode", decode, DECODES)
        if check_tensor("prompt", prompt, 2).shape[1] == 0:
            raise ValueError(f"prompt must hold at least one token per row (the first new token is sampled from "
                             f"the last prompt token's logits), got shape {tuple(prompt.shape)}")
        if prompt.dtype != torch.int64:
            raise TypeError(f"prompt must be int64 token ids, got {prompt.dtype}")
        _check_ids("prompt", prompt, self.config.vocab_size)
        if decode == "graph" and prompt.device.type != "cuda":
            raise ValueError(f"decode='graph' replays the decode step from a CUDA graph: it needs the model and "
                             f"prompt on a CUDA device, got {prompt.device}; use decode='compiled'")
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        check_number("temperature", temperature, strict=False)
        if top_k is not None:
            check_int("top_k", top_k)
        was_training = self.training
        self.eval()
        try:
            out = prompt
            if max_new_tokens == 0:
                return out
            logits, cache = self(prompt, use_cache=True)
            if decode != "functional":
                caches = self.static_caches(cache, prompt.shape[1] + max_new_tokens)
                compiled = decode != "static"
                step_fn = static_step(self.decode_static, decode, prompt.device)
            for step in range(max_new_tokens):
                nxt = sample_next(logits[:, -1], temperature, top_k, generator)
                out = torch.cat([out, nxt], dim=1)
                if step + 1 == max_new_tokens:
                    break
                if decode == "functional":
                    logits, cache = self(nxt, cache=cache)
                else:
                    logits = step_fn(nxt, caches)
                    self.static_boundary(caches, out.shape[1], compile=compiled)
            return out
        finally:
            self.train(was_training)

    def set_overrides(self, **overrides) -> dict:
        """Test-time overrides of mixer attributes, e.g. ``max_centroids=8192`` for every OVQ
        layer. Returns the previous values, one per key, the first mixer's (passed back, they restore mixers
        that agreed; :meth:`overridden` gives every mixer its own back). Each key must be one of a
        mixer's ``overrides`` (:class:`~ovqflex.layers.AttentionLayer`: read at every call, no
        parameter depends on it) and is set on every mixer that has it; a bad value is refused by
        the layer, and then no override is left set. (Any attribute had been set: ``window`` on a
        window layer, read only when it was built, changed nothing.)"""
        done = self._override(overrides)
        return {key: next(before for _, k, before in done if k == key) for key in overrides}

    @contextlib.contextmanager
    def overridden(self, **overrides):
        """:meth:`set_overrides` for a ``with`` block, after which every mixer has its own value back
        (the dict :meth:`set_overrides` returns holds one value per key: passed back, it gives mixers whose
        values differed, an OVQ and a KVM layer's ``chunk_size``, the first one's)."""
        done = self._override(overrides)
        try:
            yield self
        finally:
            _undo(done)

    def _override(self, overrides: dict) -> list[tuple[nn.Module, str, object]]:
        """Set ``overrides`` (see :meth:`set_overrides`) -> ``(mixer, key, its value before)`` of each
        value set; on an error those are undone before it is raised."""
        allowed = sorted({name for b in self.blocks for name in b.mixer.overrides})
        done: list[tuple[nn.Module, str, object]] = []
        try:
            for key, value in overrides.items():
                mixers = [b.mixer for b in self.blocks if key in b.mixer.overrides]
                if not mixers:
                    raise ValueError(f"override {key}={value!r}: no mixer of pattern {self.config.pattern!r} "
                                     f"takes {key!r} at test time; they take {allowed or 'none'}")
                for m in mixers:
                    before = getattr(m, key)
                    try:
                        setattr(m, key, value)
                    except (ValueError, TypeError) as e:  # (the layer's check, by the option's name)
                        raise type(e)(f"override {key}={value!r}: {e}") from None
                    done.append((m, key, before))
        except BaseException:
            _undo(done)
            raise
        return done

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
