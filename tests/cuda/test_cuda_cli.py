"""cuda tier: a short ``ovqflex train --device cuda`` (compiled, the tiny preset, default dtype
``auto`` = bf16 autocast, and ``--dtype fp32``; its summary line says what compiling did: no graph
break, no recompile) and ``ovqflex eval --device cuda`` on its run.

The run trains on a small byte-level text, whose loss falls within 30 steps as the model learns
the byte frequencies (the main job's recall task stays on its ln(vocab) plateau for hundreds of
steps, so 30 steps of it show nothing)."""
import json
import random

import pytest
import torch

from ovqflex.devices import to_device
from tests.cuda.cuda_cases import CUDA_TIER, DEVICE
from tests.ovqflex.training.test_trainer import _cli, metrics

pytestmark = CUDA_TIER


@pytest.mark.parametrize("dtype", ["auto", "fp32"])
def test_train_then_eval_on_the_device(tmp_path, dtype):
    run, text = tmp_path / "run", tmp_path / "text.txt"
    words = ["memory", "attention", "chunk", "state", "recall", "token", "window", "key", "value", "query"]
    rng = random.Random(0)
    text.write_text(" ".join(rng.choice(words) for _ in range(20_000)))
    proc = _cli(["train", "--device", DEVICE.type, "--dtype", dtype, "--task", "text", "--data", str(text),
                 "--steps", "30", "--warmup", "5", "--batch-size", "16", "--log-every", "1", "--no-progress",
                 "--out", str(run)])
    # compiled whole: no graph break, no recompile across its equal steps, nothing left eager
    assert "no graph break, no recompile" in proc.stdout, proc.stdout
    assert "warning: step" not in proc.stderr, proc.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows), "a loss is NaN or not positive"
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5]), "the loss did not fall"
    _cli(["eval", str(run), "--device", DEVICE.type, "--lengths", "64,128", "--examples", "8"])
    doc = json.loads((run / "eval.json").read_text())
    assert [r["length"] for r in doc["rows"]] == [64, 128]
    assert all(0 <= r["accuracy"] <= 1 for r in doc["rows"])


def test_batches_go_to_the_device_without_a_stream_sync():
    """The trainer's, eval's and the bench's batches reach the GPU through pinned memory, copied
    asynchronously (a copy from pageable memory synchronizes the stream first): equal values, and no
    synchronizing copy under ``torch.cuda.set_sync_debug_mode("error")`` while the GPU is busy. (A
    CPU dry run checks the values.)"""
    x, y = torch.randint(0, 256, (16, 2048)), torch.randint(-1, 256, (16, 2048))
    busy = torch.randn(2048, 2048, device=DEVICE)
    if DEVICE.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            busy = busy @ busy / 2048  # work queued ahead of the copies
        gx, gy = to_device(DEVICE, x, y)
    finally:
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert gx.device.type == gy.device.type == DEVICE.type
    assert torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)
