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
from ovqflex.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, set_rng_state
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


def test_a_resumed_vq_run_continues_the_devices_random_draws(tmp_path):
    """A ``swa,vq`` run whose codebook revives codes at every step (``dead_threshold`` above the counts of
    unused codes) draws their new keys with the device's generator: 4 steps, a checkpoint, a resume of 4 more
    give the uninterrupted run's losses and codebook. The checkpoints kept torch's CPU generator only, so a
    resume on CUDA drew the first steps' keys again. (Eager: a compiled step's random numbers come from the
    same generator, through the seeds inductor draws from it.)"""
    common = ["train", "--device", DEVICE.type, "--dtype", "fp32", "--task", "icr", "--task-opt", "key_len=1",
              "--task-opt", "value_len=1", "--pattern", "swa,vq", "--seq-len", "64", "--batch-size", "8",
              "--steps", "8", "--warmup", "2", "--log-every", "1", "--no-progress", "--no-compile",
              "--model-opt=d_model=32", "--model-opt=window=16", "--model-opt=chunk_size=16",
              "--model-opt=block_size=16", "--model-opt=vq.dead_threshold=0.999", "--model-opt=vq.codebook_size=64"]
    _cli([*common, "--out", str(tmp_path / "one")])
    _cli([*common, "--out", str(tmp_path / "two"), "--stop-after", "4"])
    _cli([*common, "--out", str(tmp_path / "two"), "--resume"])
    assert [r["loss"] for r in metrics(tmp_path / "two")] == [r["loss"] for r in metrics(tmp_path / "one")]
    one, two = (load_checkpoint(latest_checkpoint(tmp_path / run)).model for run in ("one", "two"))
    codebooks = [name for name in one if name.endswith("quantizer.codebook")]
    assert codebooks and all(torch.equal(one[name], two[name]) for name in codebooks)


def test_a_checkpoint_restores_the_devices_generator(tmp_path):
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(5)
    torch.rand(3, device=DEVICE)  # the device's generator in use, past its seed
    path = save_checkpoint(tmp_path, 1, model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    want = torch.rand(4, device=DEVICE)
    torch.manual_seed(0)
    set_rng_state(load_checkpoint(path).state["rng"])
    assert torch.equal(torch.rand(4, device=DEVICE), want)
