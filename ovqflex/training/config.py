"""``TrainConfig``: everything a training run is a function of (saved with every checkpoint)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from recurrences.checks import check_int, from_dict

from ..models.config import check_preset

DTYPES = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    out: str = "runs/tiny-icr"
    task: str = "icr"
    task_options: dict = field(default_factory=dict)   # on top of the preset's task scale
    data: str | None = None                            # text task: a text file or a uint16 token file
    preset: str = "tiny"
    pattern: str | None = None                         # None: the preset's pattern
    model_options: dict = field(default_factory=dict)  # HybridConfig overrides
    steps: int = 4000
    seq_len: int = 64
    batch_size: int = 32                               # global batch (split over torchrun ranks)
    lr: float = 5e-3
    min_lr: float = 1e-5
    warmup: int = 100
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    compile: bool = True
    dtype: str = "auto"                                # auto: bf16 autocast on CUDA with bf16, else fp32
    device: str = "auto"
    log_every: int = 10
    ckpt_every: int = 0                                # 0: only at the end
    keep_checkpoints: int = 2
    deterministic: bool = False
    progress: bool = True

    def __post_init__(self):
        check_preset(self.preset)  # first: an unknown preset, not the task sizes it would have set
        for name in ("steps", "seq_len", "batch_size", "log_every"):
            check_int(name, getattr(self, name))
        for name in ("warmup", "ckpt_every", "keep_checkpoints", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, what: str = "train config") -> "TrainConfig":
        """The config of ``d`` (e.g. a checkpoint's ``train_config``); unknown keys, missing keys and
        wrong types are refused by name (``what`` says where ``d`` comes from)."""
        return from_dict(cls, d, what)
