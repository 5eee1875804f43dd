"""tools/compiled_saved.py: what a compiled function's partitioned forward keeps for its backward."""
import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "compiled_saved.py"
_spec = importlib.util.spec_from_file_location("compiled_saved", SCRIPT)
compiled_saved = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled_saved)  # importing it patches nothing: main() does


def _kept(fn, *args) -> list[tuple]:
    return [(r["kind"], r["shape"], r["dtype"], r["line"].split(":")[0])
            for r in compiled_saved.kept(compiled_saved.partitioned_forward(fn, *args))]


def test_kept_tensors_are_told_apart_as_inputs_outputs_and_intermediates():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    assert [kind for kind, *_ in _kept(torch.exp, x)] == ["output"]  # exp's backward reads its output
    assert [kind for kind, *_ in _kept(torch.sin, x)] == ["input"]  # sin's reads its input
    # the product's backward reads x and w (transposed views of the inputs: no memory of their own), tanh's
    # reads tanh's output, an intermediate made on this file's line
    rows = _kept(lambda x, w: torch.tanh(x @ w).sum(-1), x, w)
    assert sorted(r[:3] for r in rows) == [("input", (4, 8), "float32"), ("input", (8, 8), "float32"),
                                           ("kept", (4, 8), "float32")]
    assert [r[3] for r in rows if r[0] == "kept"] == ["tests/tools/test_compiled_saved.py"]
