"""cuda tier: a short ``ovqflex train --device cuda`` (compiled, the tiny preset, default dtype
``auto`` = bf16 autocast, and ``--dtype fp32``) and ``ovqflex eval --device cuda`` on its run."""
import json

import pytest

from tests.cuda.cuda_cases import CUDA_TIER, DEVICE
from tests.ovqflex.training.test_trainer import _cli, metrics

pytestmark = CUDA_TIER


@pytest.mark.parametrize("dtype", ["auto", "fp32"])
def test_train_then_eval_on_the_device(tmp_path, dtype):
    run = tmp_path / "run"
    _cli(["train", "--device", DEVICE.type, "--dtype", dtype, "--steps", "30", "--warmup", "5", "--batch-size", "16",
          "--log-every", "1", "--no-progress", "--out", str(run)])
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in rows), "a loss is NaN or not positive"
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5]), "the loss did not fall"
    _cli(["eval", str(run), "--device", DEVICE.type, "--lengths", "64,128", "--examples", "8"])
    doc = json.loads((run / "eval.json").read_text())
    assert [r["length"] for r in doc["rows"]] == [64, 128]
    assert all(0 <= r["accuracy"] <= 1 for r in doc["rows"])
