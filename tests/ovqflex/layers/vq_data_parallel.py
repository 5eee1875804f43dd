"""Two gloo ranks on the CPU train VQ layers on halves of one batch (``python -m
tests.ovqflex.layers.vq_data_parallel PORT OUT [--compile]``), then one process trains the same layers on the
whole batch; prints, per case and codebook tensor, whether the ranks agree bit for bit and the largest
difference from the single process. Run by ``test_vq.py`` (a file, not ``-c``: spawned ranks import it)."""
import json
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ovqflex

#: (estimator, codebook size, dead threshold): the EMA step (no code revived in 3 steps), DiVeQ's idle counts
#: (64 codes: some used on one rank only), and every code revived at every step (threshold above any count)
CASES = {"ste": ("ste", 8, 0.01), "diveq": ("diveq", 64, 0.01), "ste-revive": ("ste", 8, 2.0)}
STEPS = 3


def _layer(case: str) -> ovqflex.VQAttention:
    estimator, size, threshold = CASES[case]
    torch.manual_seed(0)
    return ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=size, estimator=estimator,
                               dead_threshold=threshold, backend="blocked")


def _batches() -> torch.Tensor:
    return torch.randn(STEPS, 4, 48, 32, generator=torch.Generator().manual_seed(1))  # [step, B, T, hidden]


def _train(case: str, rows: slice, compiled: bool) -> dict:
    layer = _layer(case)
    step = torch.compile(layer, fullgraph=True) if compiled else layer
    for x in _batches():
        step(x[rows])
    q = layer.quantizer
    return {name: t.detach().clone() for name, t in [("codebook", q.codebook), *q.named_buffers()]}


def _rank(rank: int, port: int, out: str, compiled: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)  # each rank's own global RNG (revival draws), as separate processes have
    torch.save({case: _train(case, slice(2 * rank, 2 * rank + 2), compiled) for case in CASES}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    port, out, compiled = int(sys.argv[1]), sys.argv[2], "--compile" in sys.argv
    mp.spawn(_rank, args=(port, out, compiled), nprocs=2)
    ranks = [torch.load(f"{out}/rank{r}.pt") for r in (0, 1)]
    report = {}
    for case in CASES:
        one = _train(case, slice(None), compiled)
        report[case] = {name: {"ranks_equal": torch.equal(ranks[0][case][name], ranks[1][case][name]),
                               "from_one": (ranks[0][case][name] - t).abs().max().item()}
                        for name, t in one.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
