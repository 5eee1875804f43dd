"""Seed 002's MQAR setting at CPU scale: VLA and linear attention at n_pairs < d_head (slow)."""
import time

import pytest
import torch
import torch.nn.functional as F

from ovqflex.models import HybridConfig, HybridLM
from ovqflex.tasks import IGNORE, make_batch, make_task
from tests.recurrences.recurrent_cases import one_thread  # noqa: F401  (eager small ops: ~2 min instead of ~10)

N_PAIRS, D_HEAD, STEPS = 24, 32, 600


def train_mqar(pattern: str, steps: int = STEPS) -> float:
    """Eager AdamW on seed-002-layout MQAR (vocab 64, T = 3n + 1); returns the exact-match
    accuracy of the query positions on 256 held-out examples."""
    torch.manual_seed(0)
    task = make_task("mqar", vocab_size=64, n_pairs=N_PAIRS)
    T = task.min_len()
    model = HybridLM(HybridConfig(vocab_size=64, d_model=2 * D_HEAD, n_layers=2, n_heads=2, pattern=pattern,
                                  qk_conv=4, chunk_size=16, block_size=16, window=16,
                                  mixer_options={pattern: {"out_norm": True}}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    for step in range(steps):
        x, y = make_batch(task, seed=0, step=step, start=0, count=32, seq_len=T)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    x, y = make_batch(task, seed=1, step=0, start=0, count=256, seq_len=T)
    with torch.no_grad():
        pred = model(x).argmax(-1)
    mask = y != IGNORE
    return (pred[mask] == y[mask]).float().mean().item()


@pytest.mark.slow
def test_vla_and_linear_attention_learn_mqar_within_capacity():
    """Both recurrences learn MQAR at n_pairs < d_head (chance is 1/60). The paper's claim
    that VLA *beats* linear attention here (1.00 vs 0.07 after 2-3k steps) was not
    reproduced at this scale — VLA 0.81 vs linear 0.82 after 600 steps — so the comparison
    is printed, not asserted; issue 10 stays open on it."""
    t0 = time.perf_counter()
    vla, lin = train_mqar("vla"), train_mqar("linear")
    print(f"MQAR n_pairs={N_PAIRS} d_head={D_HEAD} {STEPS} steps: vla {vla:.3f}, linear {lin:.3f}, "
          f"{time.perf_counter() - t0:.0f} s")
    assert vla > 0.5 and lin > 0.5
