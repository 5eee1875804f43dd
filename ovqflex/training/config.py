"""``TrainConfig``: everything a training run is a function of (saved with every checkpoint).

Each field's ``metadata["help"]`` says what it means; ``ovqflex train`` derives one flag per
field from the type, default and that help (``ovqflex/cli/flags.py``), so a new field is a
new flag."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from recurrences.checks import check_choice, check_int, check_number, from_dict

from .. import devices
from ..models.config import PRESETS, check_preset
from ..tasks import TASKS

DTYPES = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    out: str = field(default="runs/tiny-icr", metadata={"help": "run directory (metrics.jsonl, checkpoints/)"})
    task: str = field(default="icr", metadata={"help": f"the task: {', '.join(TASKS)}"})
    task_options: dict = field(default_factory=dict, metadata={
        "flag": "--task-opt", "help": "task option, on top of the preset's task scale"})
    data: str | None = field(default=None, metadata={
        "help": "the text task's data: a text file (bytes) or a .bin/.u16 file of uint16 tokens"})
    preset: str = field(default="tiny", metadata={"help": f"model preset: {', '.join(PRESETS)}"})
    pattern: str | None = field(default=None, metadata={
        "help": "mixer pattern, e.g. swa,ovq (default: the preset's)"})
    model_options: dict = field(default_factory=dict, metadata={
        "flag": "--model-opt", "help": "model config (HybridConfig) override, e.g. window=16; one "
                                "method's option as MIXER.OPTION, e.g. ovq.max_centroids=4096"})
    steps: int = field(default=4000, metadata={"help": "optimizer steps"})
    seq_len: int = field(default=64, metadata={"help": "training context length (tokens)"})
    length_warmup: tuple[int, ...] = field(default=(), metadata={
        "help": "train at these shorter lengths first (increasing, each dividing --seq-len), each for an equal "
                "share of --length-warmup-steps, with seq_len / length times --batch-size sequences (the same "
                "tokens per step); e.g. 256,512,1024: a recall task whose loss plateau grows with the length "
                "learns at the short ones and keeps it at --seq-len"})
    length_warmup_steps: int = field(default=0, metadata={
        "help": "optimizer steps of the length warm-up (--length-warmup); --seq-len after them"})
    batch_size: int = field(default=32, metadata={"help": "global batch (split over torchrun ranks)"})
    lr: float = field(default=5e-3, metadata={"help": "peak learning rate (linear warmup, then cosine decay)"})
    min_lr: float = field(default=1e-5, metadata={"help": "learning rate at the end of the cosine decay"})
    warmup: int = field(default=100, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay of the matrices"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1 (first-moment decay), in [0, 1)"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2 (second-moment decay), in [0, 1)"})
    grad_clip: float = field(default=1.0, metadata={"help": "gradient norm clip (0: none; the logged grad_norm is "
                                                            "the norm before any clip)"})
    seed: int = field(default=0, metadata={"help": "seed of the model init and the data stream"})
    compile: bool = field(default=True, metadata={"help": "compile the model (torch.compile)"})
    dtype: str = field(default="auto", metadata={
        "choices": DTYPES, "help": "compute dtype; auto: bf16 autocast on CUDA with bf16, else fp32"})
    device: str = field(default=devices.AUTO, metadata={"help": devices.NAMES})
    log_every: int = field(default=10, metadata={"help": "log metrics every N steps"})
    ckpt_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0: only at the end)"})
    keep_checkpoints: int = field(default=2, metadata={"flag": "--keep", "help": "newest checkpoints to keep (0: all)"})
    deterministic: bool | None = field(default=None, metadata={
        "help": "deterministic algorithms, so that a run repeats bit for bit on the same machine and thread "
                "count (default: on for CPU, where it costs no measured speed; off for CUDA)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self):
        check_preset(self.preset)  # first: an unknown preset, not the task sizes it would have set
        check_choice("task", self.task, TASKS)
        for name in ("steps", "seq_len", "batch_size", "log_every"):
            check_int(name, getattr(self, name))
        for name in ("warmup", "ckpt_every", "keep_checkpoints", "seed", "length_warmup_steps"):
            check_int(name, getattr(self, name), minimum=0)
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            check_number(name, getattr(self, name), strict=False)
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if check_number(name, getattr(self, name), strict=False) >= 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("compile", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.deterministic is None or isinstance(self.deterministic, bool)):
            raise ValueError(f"deterministic must be True, False or None (on for CPU, off for CUDA), "
                             f"got {self.deterministic!r}")
        self._check_length_warmup()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    def _check_length_warmup(self) -> None:
        lengths = self.length_warmup
        if not isinstance(lengths, tuple) or any(isinstance(v, bool) or not isinstance(v, int) for v in lengths):
            raise ValueError(f"length_warmup must be a tuple of ints (lengths), got {lengths!r}")
        if not lengths:
            if self.length_warmup_steps:
                raise ValueError(f"length_warmup_steps={self.length_warmup_steps} needs length_warmup, the "
                                 f"lengths to train at first (e.g. 256,512)")
            return
        bad = [v for v in lengths if v < 1 or v >= self.seq_len or self.seq_len % v]
        if bad or list(lengths) != sorted(set(lengths)):
            raise ValueError(f"length_warmup must be increasing lengths shorter than seq_len={self.seq_len} that "
                             f"divide it (so every step has the same tokens), got {lengths!r}")
        if not len(lengths) <= self.length_warmup_steps < self.steps:
            raise ValueError(f"length_warmup_steps must be in [{len(lengths)}, steps={self.steps}) (a step for each "
                             f"of the {len(lengths)} warm-up lengths at least, and at least one at seq_len), got "
                             f"{self.length_warmup_steps}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, what: str = "train config") -> "TrainConfig":
        """The config of ``d`` (e.g. a checkpoint's ``train_config``); unknown keys, missing keys and
        wrong types are refused by name (``what`` says where ``d`` comes from)."""
        return from_dict(cls, d, what)
