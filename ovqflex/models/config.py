"""``HybridConfig``: every size and mixer option of a :class:`HybridLM`, plus named presets."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from recurrences.checks import check_block_size, check_chunk, check_int, from_dict


@dataclass
class HybridConfig:
    """A hybrid LM: ``n_layers`` blocks whose mixers follow ``pattern`` cyclically.

    ``pattern`` is a comma-separated list of mixer names (``"swa,ovq"`` = the OVQ paper's
    sw-ovq: sliding window with RoPE, then OVQ-attention, repeated). Attention mixers use the
    paper's unit-norm q/k with a learned per-head ``beta`` when ``qk_norm`` is set.
    """

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int | None = None
    pattern: str = "swa,ovq"
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-5
    qk_norm: bool = True
    qk_conv: int = 0                  # >0: causal depthwise conv of this width on q, k (OVQ paper, arXiv 2602.03922, appendix C)
    rope_base: float = 10000.0
    window: int = 128                 # swa: token window
    chunk_size: int = 128             # ovq / bswa / kvm / vq chunk L
    n_bswa_chunks: int = 2            # bswa / kvm: block window Nb (chunks)
    max_centroids: int = 2048         # ovq dictionary cap N
    growth: str = "plateau"
    seeding: str = "spread"
    backend: str = "auto"
    block_size: int = 128             # attention block (flex BLOCK_SIZE / blocked tile)
    init_std: float = 0.02
    mixer_options: dict = field(default_factory=dict)  # per-mixer extra kwargs: {"ovq": {...}}

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "window", "n_bswa_chunks", "max_centroids"):
            check_int(name, getattr(self, name))
        check_chunk("chunk_size", self.chunk_size)
        check_block_size("block_size", self.block_size)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                             f"(or give head_dim)")
        if not self.mixers:
            raise ValueError(f"pattern must name at least one mixer, got {self.pattern!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")

    @property
    def mixers(self) -> list[str]:
        """The mixer name of every layer: ``pattern`` repeated to ``n_layers``."""
        names = [m.strip() for m in self.pattern.split(",") if m.strip()]
        return [names[i % len(names)] for i in range(self.n_layers)] if names else []

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, what: str = "model config") -> "HybridConfig":
        """The config of ``d``; unknown keys (with the nearest valid one), missing keys and wrong
        types are refused by name (``what`` says where ``d`` comes from). The key ``bswa_chunks`` of
        configs saved before its rename is read as ``n_bswa_chunks``, with a DeprecationWarning (this
        release only)."""
        if isinstance(d, dict) and "bswa_chunks" in d and "n_bswa_chunks" not in d:
            warnings.warn(f"{what}: bswa_chunks is renamed n_bswa_chunks", DeprecationWarning, stacklevel=2)
            d = {("n_bswa_chunks" if key == "bswa_chunks" else key): value for key, value in d.items()}
        return from_dict(cls, d, what)


#: Named presets: overrides of the defaults. ``tiny`` learns basic ICR on a 2-core CPU in
#: minutes: 2 layers, width 128, chunks of 16, the OVQ paper's appendix-C q/k convolution
#: (width 4), without which this size does not leave the ICR loss plateau within a CPU
#: budget, and the paper's dictionary cap N = 2048 (with N = 256 the plateau schedule
#: already merges 8 of the first 48 tokens, and runs of 3,000 steps ended at 0.72-0.85).
#: Its sliding window is 8 tokens: the window must be a small part of the training context,
#: as in the paper (128 of 4k). With a 32-token window at the 64-token training length, 55%
#: of the ICR targets have their key inside the window, so training first learns recall
#: through the RoPE window layer (accuracy jumps to ~0.6, then creeps up) and the OVQ layer
#: only learns a solution for the few oldest pairs, which does not extrapolate: measured
#: 1.00 / 0.56 / 0.34 at 64 / 128 / 256 tokens, with the window-visible targets at 256 all
#: right and the others 0.26 (scaling the OVQ layer's beta by 3 only lifts them to 0.34).
#: With window 8 (6% of the targets) the OVQ layer does the recall: 1.00 / 1.00 / 0.995.
#: ``paper-icr`` is the OVQ paper's synthetic-task model (arXiv 2602.03922, §4.1, §8.2:
#: 8 layers, width 768, head dim 128, window 128, chunk 128, N = 2k, vocab 10k).
PRESETS: dict[str, dict] = {
    "tiny": dict(d_model=128, n_layers=2, n_heads=2, window=8, chunk_size=16, block_size=32, max_centroids=2048,
                 qk_conv=4),
    "small": dict(d_model=256, n_layers=4, n_heads=4, window=128, chunk_size=128, max_centroids=1024),
    "paper-icr": dict(vocab_size=10000, d_model=768, n_layers=8, n_heads=6, head_dim=128, window=128,
                      chunk_size=128, max_centroids=2048),
}


def preset(name: str, **overrides) -> HybridConfig:
    """``HybridConfig`` of preset ``name`` with ``overrides`` applied (e.g. ``pattern``, ``vocab_size``)."""
    check_preset(name)
    return HybridConfig.from_dict({**PRESETS[name], **overrides}, f"model config (preset {name!r})")


def check_preset(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return name
