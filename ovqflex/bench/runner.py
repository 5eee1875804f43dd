"""Load a benchmark profile (TOML), run its scenarios, print a table, write JSON.

A profile::

    name = "blockmask"
    description = "..."
    [[scenario]]
    kind = "blockmask"      # a key of ovqflex.bench.scenarios.KINDS
    seq_len = 65536
    ...
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch
from tabulate import tabulate

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .scenarios import KINDS


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile {str(path)!r} does not exist")
    try:
        prof = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"profile {str(path)!r} is not valid TOML: {e}") from e
    scenarios = prof.get("scenario")
    if not isinstance(scenarios, list) or not scenarios:
        raise ValueError(f"profile {str(path)!r} has no [[scenario]] tables")
    for i, sc in enumerate(scenarios):
        if sc.get("kind") not in KINDS:
            raise ValueError(f"scenario {i} of {str(path)!r}: kind must be one of {sorted(KINDS)}, got {sc.get('kind')!r}")
    prof.setdefault("name", path.stem)
    return prof


def run_profile(path: str | Path, *, device: str | None = None, out_dir: str | Path = "bench-out",
                only: str | None = None) -> list[dict]:
    prof = load_profile(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict] = []
    for sc in prof["scenario"]:
        if only and only not in str(sc.get("name", sc["kind"])):
            continue
        rows += KINDS[sc["kind"]](sc, device)
    print(f"profile {prof['name']}: {prof.get('description', '')}".rstrip(": "))
    print(f"torch {torch.__version__}, device {device}, {os.cpu_count()} cpu threads={torch.get_num_threads()}")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dest = out / f"{prof['name']}.json"
    tmp = dest.with_suffix(".json.tmp")
    meta = {"profile": prof["name"], "torch": torch.__version__, "device": device, "machine": platform.machine(),
            "threads": torch.get_num_threads()}
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    tmp.replace(dest)
    print(f"wrote {dest}")
    return rows
