"""Checkpoints: safetensors tensors + a JSON state, written atomically, verified on load.

Layout of a run directory ``DIR``::

    DIR/checkpoints/step_00000100/model.safetensors      model weights
    DIR/checkpoints/step_00000100/optimizer.safetensors  optimizer tensors ("<param index>.<name>")
    DIR/checkpoints/step_00000100/state.json             step, configs, optimizer groups, RNG
    DIR/checkpoints/step_00000100/manifest.json          size and SHA-256 of each of the three files above

A checkpoint is written into a temporary directory (``.tmp-step_...``): the tensor files and
``state.json``, then, last, ``manifest.json`` with the size and SHA-256 of every other file;
everything is fsynced and the directory renamed into place. A ``step_*`` directory therefore
only ever exists complete, and the newest one is the run's latest checkpoint: a crash at any
point (even between the write and the rename) leaves the checkpoints before it as they were,
plus a dot-named leftover that the next run of the directory removes. Old checkpoints are
pruned by renaming them to a dot name first, so a crash never leaves half a ``step_*``.

On load every file is checked against the manifest (state.json included), so a truncated,
corrupted or edited checkpoint is refused with an error that names the file. Checkpoints of
format version 1 (no manifest; state.json unchecked) are refused with that reason.

Fault injection for the crash tests (``tests/ovqflex/training/test_fault_injection.py``): the
environment variable ``OVQFLEX_FAULT_CHECKPOINT`` set to ``pause=SECONDS`` makes the writer
sleep between the write of a checkpoint and its rename (so a kill from outside can land
there), ``kill=STEP`` makes it SIGKILL itself at that point of checkpoint ``STEP``.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMAT = "ovqflex-checkpoint"
VERSION = 2
MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.safetensors"
STATE_FILE, MANIFEST_FILE = "state.json", "manifest.json"
FAULT_ENV = "OVQFLEX_FAULT_CHECKPOINT"


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


def _write_json(path: Path, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fault_point(step: int) -> None:
    """Between the write of checkpoint ``step`` and its rename: the test hook (module docstring)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    what, _, value = spec.partition("=")
    if what == "pause":
        time.sleep(float(value))
    elif what == "kill" and int(value) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    elif what not in ("pause", "kill"):
        raise ValueError(f"{FAULT_ENV} must be pause=SECONDS or kill=STEP, got {spec!r}")


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """The random generators a resume must continue: torch's CPU generator, Python's, and, once CUDA is in
    use, each CUDA device's (a VQ codebook's revival draws run on the device: a resume that reseeded it
    would repeat the first steps' draws)."""
    state = {"torch": _encode(torch.get_rng_state()), "python": repr(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`'s generators (the CUDA devices that both machines have)."""
    torch.set_rng_state(_decode(state["torch"]))
    import ast

    version, internal, gauss = ast.literal_eval(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if state.get("cuda") and torch.cuda.is_available():
        for device, text in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_decode(text), device)


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
    save_file(weights, str(tmp / MODEL_FILE))
    opt_tensors, opt_meta = _optimizer_split(optimizer.state_dict())
    save_file(opt_tensors, str(tmp / OPTIMIZER_FILE))
    _write_json(tmp / STATE_FILE, {"format": FORMAT, "version": VERSION, "step": step, "optimizer": opt_meta,
                                   "rng": rng_state(), **state})
    files = {}
    for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
        _fsync(tmp / name)
        files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
    _write_json(tmp / MANIFEST_FILE, {"format": FORMAT, "version": VERSION, "files": files})
    _fsync(tmp)
    _fault_point(step)
    if final.exists():  # re-saving a step (resumed from an older one): move the old one aside first
        _discard(final)
    os.rename(tmp, final)
    _fsync(root)
    for stale in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        _discard(stale)
    return final


def _discard(path: Path) -> None:
    """Remove a checkpoint directory: renamed to a dot name first, so it is never half a ``step_*``."""
    aside = path.with_name(f".del-{path.name}-{os.getpid()}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(run_dir: str | os.PathLike) -> list[Path]:
    """Remove what killed writers left: dot-named temp and discarded directories under
    ``run_dir/checkpoints`` and dot-named ``*.tmp-<pid>`` files in ``run_dir``. Only for the run's
    single writer (it holds the run lock)."""
    root = checkpoint_dir(run_dir)
    gone = (sorted(root.glob(".*")) if root.is_dir() else []) + sorted(Path(run_dir).glob(".*.tmp-*"))
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return gone


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The run's checkpoint directories, oldest first (all complete: see the module docstring)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of the run, or ``None`` when it has none."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def run_checkpoint(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> Path:
    """The checkpoint of run ``run_dir`` that ``checkpoint`` names: ``None`` its latest; else one of its
    checkpoint directories, by path or by name (``step_00004000``). A checkpoint of another run is refused:
    what eval and probe measure with it is written into ``run_dir``, under that run's name."""
    found = list_checkpoints(run_dir)
    if checkpoint is None:
        if not found:
            raise CheckpointError(f"{run_dir} has no checkpoint (train it first: ovqflex train --out {run_dir})")
        return found[-1]
    for path in (Path(checkpoint), checkpoint_dir(run_dir) / checkpoint):
        if path.is_dir() and any(path.resolve() == p.resolve() for p in found):
            return path
    names = ", ".join(p.name for p in found) or "none"
    if Path(checkpoint).is_dir():
        raise CheckpointError(f"checkpoint {checkpoint} is not one of run {run_dir}'s checkpoints ({names}): its "
                              f"report would be written into {run_dir}; evaluate the run it belongs to")
    raise CheckpointError(f"run {run_dir} has no checkpoint {str(checkpoint)!r}; its checkpoints: {names}")


def _read_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupted: not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an {FORMAT} {what}")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {doc.get('version')}, this ovqflex reads {VERSION}")
    return doc


def read_state(path: str | os.PathLike) -> dict:
    """``state.json`` of checkpoint ``path``, after every file was checked against the manifest."""
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.exists():
        try:
            old = json.loads((path / STATE_FILE).read_text()).get("version") == 1
        except (OSError, ValueError, AttributeError):
            old = False
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST_FILE}: " + (
            "written by an older ovqflex (checkpoint format 1, whose state.json is not checksummed); "
            "evaluate or resume it with that version" if old else "incomplete or not a checkpoint"))
    files = _read_json(manifest, "manifest").get("files")
    if (not isinstance(files, dict) or set(files) != {MODEL_FILE, OPTIMIZER_FILE, STATE_FILE}
            or not all(isinstance(m, dict) and {"bytes", "sha256"} <= set(m) for m in files.values())):
        raise CheckpointError(f"{manifest} must give bytes and sha256 of {MODEL_FILE}, {OPTIMIZER_FILE} and "
                              f"{STATE_FILE}, got {files!r}")
    for name, meta in files.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or changed: {size} bytes, "
                                  f"expected {meta['bytes']} ({MANIFEST_FILE})")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is corrupted or was edited: SHA-256 does not match "
                                  f"{MANIFEST_FILE}")
    return _read_json(path / STATE_FILE, "state file")


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read and verify checkpoint directory ``path``."""
    path = Path(path)
    doc = read_state(path)
    try:
        model = load_file(str(path / MODEL_FILE), device=str(map_location))
        opt_tensors = load_file(str(path / OPTIMIZER_FILE), device=str(map_location))
    except Exception as e:  # safetensors raises its own error types on bad headers
        raise CheckpointError(f"checkpoint {path} could not be read: {e}") from e
    optimizer = _optimizer_join(opt_tensors, doc.pop("optimizer"))
    return Checkpoint(path=path, step=int(doc["step"]), model=model, optimizer=optimizer, state=doc)


def load_tensors(module: torch.nn.Module, tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """``module.load_state_dict(tensors)``, refusing (naming the file ``path`` and the tensors) a
    missing, unexpected or differently shaped tensor instead of torch's traceback."""
    expected = module.state_dict()
    problems = [f"{k}: missing" for k in expected if k not in tensors]
    problems += [f"{k}: not in the model" for k in tensors if k not in expected]
    problems += [f"{k}: shape {list(tensors[k].shape)}, the model has {list(v.shape)}"
                 for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint file {path} does not fit the model: {'; '.join(problems[:5])}{more}")
    module.load_state_dict(tensors)


def load_optimizer(optimizer: torch.optim.Optimizer, ckpt: Checkpoint) -> None:
    """``optimizer.load_state_dict`` of checkpoint ``ckpt``'s optimizer state, a misfit refused
    with the file named."""
    try:
        optimizer.load_state_dict(ckpt.optimizer)
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {ckpt.path / OPTIMIZER_FILE} does not fit the optimizer: "
                              f"{e}") from None
