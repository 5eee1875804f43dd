"""Small programs of every region kind, and the dense truth the views are checked against."""
import torch

from masks.program import build_program
from masks.regions import BlockWindow, Causal, OwnChunk, Sinks, StateBank, TokenWindow
from ovqflex.ops.ovq import ovq_program

# drawing priority stated by the visualizer's contract: sink > state > window > causal
PRIORITY = ("sink", "state", "window", "causal")


def make_program(kind: str, T: int = 80, block: int = 16, H: int = 2):
    """A seeded program of ``kind`` on ``T`` tokens; the 'bank' kind has empty (-inf) state rows; the 'versioned'
    kind is OVQ's versioned layout, whose rows live per head, on at least 128 tokens, with heads that differ
    (head 1's keys nearly one: other rows live and die than head 0's; at 80 tokens the two heads' views agree)."""
    g = torch.Generator().manual_seed(1)
    if kind == "versioned":
        q, k, v = (torch.randn(1, H, max(T, 128), 8, generator=g) for _ in range(3))
        k[:, 1] = k[:, 1, :1] + 0.01 * k[:, 1]
        return ovq_program(q, k, v, torch.ones(H), chunk_size=16, max_centroids=64, state_layout="versioned",
                           block_size=block)[0]
    q, k, v = (torch.randn(1, H, T, 8, generator=g) for _ in range(3))
    if kind == "bank":
        chunk, rows = 32, 24
        n_chunks = -(-T // chunk)
        live = torch.tensor([min(c * 12, rows) for c in range(n_chunks)])  # chunk 2 reads its rows 20..23
        counts = torch.randint(1, 5, (1, H, n_chunks, rows), generator=g).float()
        counts[:, :, :, 20:] = 0  # rows 20.. of every bank are empty: bias -inf although "live"
        bias = torch.where(counts > 0, counts.log(), float("-inf")).flatten(2)
        sk, sv = (torch.randn(1, H, n_chunks * rows, 8, generator=g) for _ in range(2))
        return build_program(q, k, v, (StateBank(rows, chunk, live), OwnChunk(chunk)), scale=1.0,
                             state_k=sk, state_v=sv, state_bias=bias, block_size=block)
    regions = {"causal": (Causal(),), "swa": (TokenWindow(20),), "bswa": (BlockWindow(2, 16),),
               "sinks": (Sinks(3), TokenWindow(12)),
               "late-sinks": (TokenWindow(12), Sinks(3))}[kind]  # drawn by priority, not program order
    return build_program(q, k, v, regions, scale=0.5, block_size=block)


KINDS = ["causal", "swa", "bswa", "sinks", "late-sinks", "bank", "versioned"]


def dense_truth(program, head: int = 0):
    """``(names, labels [q_len, S + q_len])`` of batch row 0 and ``head`` from a dense evaluation of every region,
    written here independently of ``masks.viz``: a cell takes the first region name in PRIORITY that
    contains it; cells of rows with bias -inf are masked (label 0)."""
    g = program.geom
    qi = torch.arange(g.q_len)[:, None]
    kv = torch.arange(g.n_state + g.q_len)[None, :]
    b, h = torch.tensor(0), torch.tensor(head)
    present = {r.name for r in program.regions}
    names = ["masked"] + [n for n in PRIORITY if n in present]
    labels = torch.zeros(g.q_len, g.n_state + g.q_len, dtype=torch.long)
    for k in range(len(names) - 1, 0, -1):  # paint lowest priority first, higher ones over it
        for r, p in zip(program.regions, program.params):
            if r.name == names[k]:
                labels[r.contains(p, qi, kv, b, h).expand_as(labels)] = k
    if program.bias is not None:
        dead = torch.isneginf(program.bias[0, head, : g.n_state + g.q_len])
        labels[:, dead] = 0
    return names, labels
