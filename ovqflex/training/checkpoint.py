"""Checkpoints: safetensors tensors + a JSON state, written atomically, verified on load.

Layout of a run directory ``DIR``::

    DIR/checkpoints/step_00000100/model.safetensors      model weights
    DIR/checkpoints/step_00000100/optimizer.safetensors  optimizer tensors ("<param index>.<name>")
    DIR/checkpoints/step_00000100/state.json             step, configs, optimizer groups, RNG, file hashes
    DIR/checkpoints/latest                               name of the newest complete checkpoint

A checkpoint is written into a temporary directory, fsynced, and renamed into place;
only then is ``latest`` replaced (temp file + ``os.replace``). A crash at any point
leaves the previous checkpoint and ``latest`` untouched. On load every file's size and
SHA-256 are checked against ``state.json``, so a truncated or corrupted checkpoint is
refused with an error that names the file.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMAT = "ovqflex-checkpoint"
VERSION = 1
_MODEL, _OPTIM, _STATE, _LATEST = "model.safetensors", "optimizer.safetensors", "state.json", "latest"


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupted or from an incompatible run."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict            # a torch optimizer state_dict
    state: dict                # everything else of state.json (configs, rng, metrics)


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def rng_state() -> dict:
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "python": repr(random.getstate())}


def set_rng_state(state: dict) -> None:
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    import ast

    version, internal, gauss = ast.literal_eval(state["python"])
    random.setstate((version, tuple(internal), gauss))


def _optimizer_split(opt_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A torch optimizer state_dict -> (tensors by "<index>.<name>", JSON-able rest)."""
    tensors, scalars = {}, {}
    for idx, entry in opt_state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": opt_state["param_groups"], "scalars": scalars}


def _optimizer_join(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    # JSON turned tuples (betas) into lists; give the optimizer back what it saved
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
              for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: dict, keep: int = 2) -> Path:
    """Write checkpoint ``step`` of ``model``/``optimizer`` plus ``state`` (JSON-able) under
    ``run_dir`` atomically; keep the newest ``keep`` checkpoints. Returns its directory."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / _MODEL))
    opt_tensors, opt_meta = _optimizer_split(optimizer.state_dict())
    save_file(opt_tensors, str(tmp / _OPTIM))
    files = {}
    for name in (_MODEL, _OPTIM):
        _fsync(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    doc = {"format": FORMAT, "version": VERSION, "step": step, "files": files, "optimizer": opt_meta,
           "rng": rng_state(), **state}
    with open(tmp / _STATE, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync(root)
    _write_text_atomic(root / _LATEST, final.name + "\n")
    for stale in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete-looking checkpoint directories, oldest first (temp directories excluded)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or ``None`` when the run has none."""
    root = checkpoint_dir(run_dir)
    pointer = root / _LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not name.startswith("step_") or not path.is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory under {root}")
    return path


def read_state(path: str | os.PathLike) -> dict:
    """``state.json`` of checkpoint ``path``, validated (format, version, file sizes and hashes)."""
    path = Path(path)
    state_file = path / _STATE
    if not state_file.exists():
        raise CheckpointError(f"checkpoint {path} has no {_STATE} (incomplete or not a checkpoint)")
    try:
        doc = json.loads(state_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {state_file} is corrupted: not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{state_file} is not an {FORMAT} state file")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{state_file} has version {doc.get('version')}, this ovqflex reads {VERSION}")
    for name, meta in doc["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or changed: {size} bytes, "
                                  f"expected {meta['bytes']}")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupted: SHA-256 does not match {_STATE}")
    return doc


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read and verify checkpoint directory ``path``."""
    path = Path(path)
    doc = read_state(path)
    try:
        model = load_file(str(path / _MODEL), device=str(map_location))
        opt_tensors = load_file(str(path / _OPTIM), device=str(map_location))
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise CheckpointError(f"checkpoint {path} could not be read: {e}") from e
    optimizer = _optimizer_join(opt_tensors, doc.pop("optimizer"))
    return Checkpoint(path=path, step=int(doc["step"]), model=model, optimizer=optimizer, state=doc)
