"""Benchmark scenarios: each ``kind`` of a profile's ``[[scenario]]`` maps to a function
returning a list of result rows (dicts) measured in this process."""
from __future__ import annotations

import torch

from masks.blocks import build_block_layout
from masks.regions import Geometry, OwnChunk, StateBank

from .measure import measure


def blockmask(sc: dict, device: str) -> list[dict]:
    """Build the analytic block mask of a per-chunk state bank program (SPEC §3.2).

    Keys: ``seq_len``, ``chunk_size``, ``state_rows`` (rows of each chunk's bank),
    ``block_size`` (128), ``with_q_side`` (also the backward's transposed lists).
    """
    T, C, N = int(sc["seq_len"]), int(sc["chunk_size"]), int(sc["state_rows"])
    blk = int(sc.get("block_size", 128))
    with_q = bool(sc.get("with_q_side", False))
    dev = torch.device(device)
    n_chunks = -(-T // C)
    live = torch.clamp(torch.arange(n_chunks, device=dev) * C * N // (torch.arange(n_chunks, device=dev) * C + N), max=N)
    geom = Geometry(T, T, -(-n_chunks * N // blk) * blk, T, blk, blk)
    regions = (StateBank(N, C, live), OwnChunk(C))

    def build():
        params = tuple(r.params(geom, dev) for r in regions)
        lay = build_block_layout(regions, params, geom)
        bm = lay.block_mask(lambda b, h, q, kv: q >= 0, with_q_side=with_q)
        return lay, bm

    m = measure(build, device=dev, repeats=int(sc.get("repeats", 3)))
    lay, bm = build()
    visible = int(lay.visible_blocks())
    total = geom.n_q_blocks * geom.n_kv_blocks
    return [{
        "scenario": sc.get("name", "blockmask"),
        "T": T,
        "kv_rows": geom.kv_len,
        "q_side": with_q,
        "visible_blocks": visible,
        "block_sparsity": 1 - visible / total,
        "time_s": m.seconds,
        "peak_mb": m.peak_mb,
        "dense_mask_would_be_gb": T * geom.kv_len / 2**30,
    }]


KINDS = {"blockmask": blockmask}
