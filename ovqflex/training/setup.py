"""Build what a run needs from its :class:`TrainConfig`: task, model, optimizer, autocast; and
rebuild them from a checkpoint, checked against each other."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

from recurrences.checks import ConfigError

from ..models import HybridConfig, HybridLM, preset
from ..tasks import Task, make_task
from .checkpoint import MODEL_FILE, STATE_FILE, Checkpoint, CheckpointError, load_tensors
from .config import TrainConfig

#: Task sizes per model preset, under the user's ``task_options``. ``tiny`` shrinks the
#: papers' tasks (vocab 10k, 8-token keys/values, 12-token ICL examples) so a CPU learns
#: them in minutes; larger presets use the papers' sizes (the tasks' own defaults).
TASK_SCALES: dict[str, dict[str, dict]] = {
    "tiny": {
        "icr": dict(vocab_size=256, key_len=1, value_len=1, min_pairs=1),
        "picr": dict(vocab_size=64, key_len=1, value_len=1),
        "icl": dict(vocab_size=512, io_len=4, n_functions=4),
        "mqar": dict(vocab_size=256),
        "copy": dict(vocab_size=64),
        "niah": dict(vocab_size=64, key_len=1, value_len=1),
    },
}


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA devices that support it (``dtype=auto``), or when asked; else None (fp32)."""
    if cfg.dtype == "fp32":
        return None
    if cfg.dtype == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


#: the widest vectors inductor's C++ may use for a compiled bf16 run on a CPU: its AVX-512 code for
#: several bf16 32 x 32 tile transposes in one fused loop gives wrong values (torch 2.11 and 2.13, GCC 12:
#: NaN gradients of the compiled bf16 DeltaNet and LongVQ hybrids; docs/torch-versions.md)
BF16_CPU_SIMD_BITS = 256


@contextlib.contextmanager
def bf16_cpu_codegen(device: torch.device, amp: torch.dtype | None, compiled: bool):
    """A context for running a compiled model under ``amp`` autocast on ``device``: on a CPU whose
    inductor code would use vectors wider than :data:`BF16_CPU_SIMD_BITS` (AVX-512) with bf16, that
    width (``torch._inductor.config.cpp.simdlen``; AVX2-width code) while inside, restored after;
    otherwise nothing. Graphs compile lazily, at their first call, so the model's calls go inside."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    narrow = (compiled and device.type == "cpu" and amp == torch.bfloat16
              and inductor_config.cpp.simdlen is None  # else a width the caller chose
              and pick_vec_isa().bit_width() > BF16_CPU_SIMD_BITS)
    with inductor_config.patch({"cpp.simdlen": BF16_CPU_SIMD_BITS}) if narrow else contextlib.nullcontext():
        yield


def task_options(cfg: TrainConfig) -> dict:
    options = {**TASK_SCALES.get(cfg.preset, {}).get(cfg.task, {}), **cfg.task_options}
    if cfg.task == "text":
        if not cfg.data:
            raise ValueError("task 'text' needs a data file: --data FILE (a text file, or .bin/.u16 uint16 tokens)")
        options["path"] = cfg.data
    elif cfg.data:
        raise ValueError(f"--data is only used by --task text, not by task {cfg.task!r}")
    return options


def check_lengths(task, lengths: list[int], what: str = "eval length") -> None:
    """Refuse, before any model work, a length the task cannot generate: below its
    ``min_len()``, or too long for its vocabulary or data (e.g. more distinct keys than exist). The
    example drawn is the evaluated task's (:meth:`Task.evaluation`): a training mix's options only
    ever make an example smaller, so a length it makes is one every draw can make."""
    full = task.evaluation()
    for length in lengths:
        if length < task.min_len():
            raise ValueError(f"{what} {length} is too short for task {task.name!r} (needs >= {task.min_len()})")
        try:
            full.example(length, torch.Generator().manual_seed(0))
        except ValueError as e:
            raise ValueError(f"{what} {length} is too long for task {task.name!r} ({task.describe()}): {e}") from None


def build_task(cfg: TrainConfig) -> Task:
    """The task of ``cfg``, refused (before anything is written) when it cannot make an example at each
    training length: the length warm-up's and ``seq_len``."""
    task = make_task(cfg.task, **task_options(cfg))
    check_lengths(task, [*cfg.length_warmup, cfg.seq_len], "training length")
    return task


def model_config(cfg: TrainConfig, task: Task) -> HybridConfig:
    """The preset with ``model_options``, the ``pattern`` and the task's vocabulary on top. A model option that
    contradicts the other two is refused by name (the other had silently won)."""
    overrides = dict(cfg.model_options)
    for key, value, source in (("pattern", cfg.pattern, "--pattern"),
                               ("vocab_size", task.vocab_size, f"task {cfg.task!r} (--task-opt vocab_size=N)")):
        if value is None:
            continue
        if key in overrides and overrides[key] != value:
            raise ValueError(f"model_options sets {key}={overrides[key]!r}, but {source} makes it {value!r}: "
                             f"set it in one place")
        overrides[key] = value
    return preset(cfg.preset, **overrides)


def build_model(cfg: TrainConfig, task: Task) -> HybridLM:
    return HybridLM(model_config(cfg, task))


def train_config_of(ckpt: Checkpoint) -> TrainConfig:
    """The :class:`TrainConfig` saved in checkpoint ``ckpt`` (refused by name when invalid)."""
    try:
        return TrainConfig.from_dict(ckpt.state.get("train_config"), "train_config")
    except (ValueError, ConfigError) as e:
        raise CheckpointError(f"checkpoint file {ckpt.path / STATE_FILE}: invalid train_config ({e})") from None


def model_from_checkpoint(ckpt: Checkpoint, cfg: TrainConfig, task: Task) -> HybridLM:
    """The model of checkpoint ``ckpt``: rebuilt from its saved ``model_config`` (the manifest's
    checksum covers it), with its tensors loaded (shapes checked, file named). Where the config
    ``cfg`` builds today for ``task`` differs (a preset or default changed since the run was saved,
    e.g. the ``tiny`` preset's pattern), the saved one wins and a warning names the fields."""
    state_file = ckpt.path / STATE_FILE
    try:
        saved = HybridConfig.from_dict(ckpt.state.get("model_config"), "model_config")
    except (ValueError, ConfigError) as e:
        raise CheckpointError(f"checkpoint file {state_file}: invalid model_config ({e})") from None
    expected = model_config(cfg, task)
    diffs = [f"{f.name}: {getattr(saved, f.name)!r} saved, {getattr(expected, f.name)!r} now"
             for f in dataclasses.fields(HybridConfig) if getattr(saved, f.name) != getattr(expected, f.name)]
    if diffs:
        warnings.warn(f"checkpoint {ckpt.path}: its train_config builds another model today ({'; '.join(diffs)}): "
                      "a preset or default changed since it was saved; using its saved model_config", stacklevel=2)
    model = HybridLM(saved)
    load_tensors(model, ckpt.model, ckpt.path / MODEL_FILE)
    return model


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (linears, embedding), none on norms and per-head scalars."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
