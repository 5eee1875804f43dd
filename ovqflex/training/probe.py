"""Where a trained model's attention layers look when it recalls (``ovqflex probe``).

On the ``icr`` task, a query ``Kq → Vq`` is answered at the ``→`` after its key: that position
predicts the first value token. The probe reads every probed layer's attention weights there
(softmax over the earlier tokens, per head) and reports, over the queries of unseen examples:

- the weight on the queried pair in the context, ``K → V |`` (the tokens at offsets
  ``0 .. pair-1`` from the first token of its key): median and 10th percentile;
- where the most-weighted token lies, as an offset from that key: the most frequent offsets
  and the share of queries at each.

A layer that does the recall directly puts its weight on the pair; one that matches on
something else shows where (e.g. a delimiter a window's reach after the key, where a
window layer below it has averaged the pair in). docs/experiments.md (the main job) reads seeds this way.

Probed mixers: every plain attention layer (``full``, ``nope``, ``swa``), through its own
attention program (:meth:`~ovqflex.layers.plain.CausalAttention.program`), and OVQ-attention,
through its exact token attention ``softmax(beta q̂ · k̂)`` over all earlier tokens: what its
dictionary approximates, not the compressed attention it runs (routing merges similar keys
into one row whose ``log(count)`` bias keeps their summed weight). Other mixers are listed as
not probed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from masks.program import AttentionProgram, build_program

from ..layers.ovq import OVQAttention
from ..layers.plain import _PlainAttention
from ..ops.plain import plain_regions
from ..tasks import IGNORE
from ..tasks.recall import ASSIGN, ICR
from .evaluate import check_counts, eval_batches, load_run
from .setup import check_lengths
from .trainer import forward_loss


@dataclass
class HeadProbe:
    """One head of one probed layer: the weight on the queried pair (median, 10th percentile)
    and the most frequent offsets of the most-weighted token from the queried key, with their
    share of the queries."""

    layer: int
    mixer: str
    head: int
    pair_weight: float
    pair_weight_q10: float
    offsets: list[tuple[int, float]]


def dense_attention(program: AttentionProgram, rows: Tensor) -> Tensor:
    """The attention weights ``[Q, H, q_len]`` of the queries ``rows`` ``[Q, 2]`` (example, query
    position) over a program's token rows only (no state rows: a plain attention layer's), from its
    q, k, scale, bias (``build_program`` gives one to state rows only, but a program may carry one) and
    ``mask_mod``; memory ``Q * q_len``, not ``q_len ** 2``, so the probe reads long contexts."""
    g = program.geom
    if g.n_state:
        raise ValueError(f"dense_attention reads programs of token rows only, got {g.n_state} state rows")
    T = g.q_len
    q, k = program.q[:, :, :T].float(), program.k[:, :, :T].float()
    b, t = rows.to(q.device).unbind(1)
    scores = torch.einsum("qhd,qhkd->qhk", q[b, :, t], k[b]) * program.scale  # [Q, H, T]
    if program.bias is not None:
        scores = scores + program.bias[b, :, :T].float()
    zero = t.new_zeros(())
    visible = program.mask_mod(zero, zero, t.view(-1, 1, 1), torch.arange(T, device=q.device).view(1, 1, -1))
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


def layer_attention(mixer, x: Tensor, rows: Tensor) -> Tensor | None:
    """Attention weights ``[Q, H, T]`` of ``mixer`` on its input x ``[B, T, hidden]`` at the
    queries ``rows`` ``[Q, 2]`` (:func:`dense_attention`); None for a mixer the probe does not
    read. OVQ: its exact token attention (module docstring)."""
    if isinstance(mixer, _PlainAttention):
        return dense_attention(mixer.program(x), rows)
    if isinstance(mixer, OVQAttention):  # the layer's own beta q̂ and unit keys, as its decode step scores them
        q_scaled, kn, v, _ = mixer._decode_inputs(mixer.split_heads_cached(x, None))
        program = build_program(q_scaled.float(), kn, v.float(), plain_regions(), scale=1.0,
                                block_size=mixer.options.block_size)
        return dense_attention(program, rows)
    return None


def recall_queries(tokens: Tensor, labels: Tensor, key_len: int) -> Tensor:
    """``[Q, 3]`` rows ``(example, position, key start)``: each query's ``→`` position (it predicts
    the first value token) and the first token of the same key in the context.

    tokens, labels ``[B, T]`` of the ``icr`` task (labels ``IGNORE`` except on value tokens)."""
    rows = []
    for b, t in ((labels != IGNORE) & (tokens == ASSIGN)).nonzero().tolist():
        key = tokens[b, t - key_len:t]
        windows = tokens[b, :t - key_len].unfold(0, key_len + 1, 1)  # [n, key_len + 1]
        match = ((windows[:, :key_len] == key).all(1) & (windows[:, key_len] == ASSIGN)).nonzero()
        if not len(match):
            raise ValueError(f"example {b}: the key queried at position {t} is not in its context")
        rows.append((b, t, int(match[0, 0])))
    return torch.tensor(rows, dtype=torch.long).view(-1, 3)


def pair_statistics(rows: Tensor, key_start: Tensor, pair_len: int, top: int = 3) -> list[tuple[float, float, list]]:
    """Per head of ``rows`` ``[Q, H, T]`` (each query's attention weights): ``(median, 10th
    percentile of the weight on the queried pair, [(offset, share), ...] of the most-weighted
    token's offset from the key)``; ``key_start`` ``[Q]`` is where each query's key starts in
    the context (:func:`recall_queries`); offsets most frequent first, at most ``top``."""
    rows = rows.float()
    span = key_start.view(-1, 1, 1) + torch.arange(pair_len)  # [Q, 1, pair_len]
    on_pair = rows.gather(2, span.expand(-1, rows.shape[1], -1)).sum(2)  # [Q, H]
    offsets = rows.argmax(2) - key_start.view(-1, 1)  # [Q, H]
    out = []
    for h in range(rows.shape[1]):
        values, counts = offsets[:, h].unique(return_counts=True)
        order = counts.argsort(descending=True, stable=True)[:top]
        share = [(int(values[i]), float(counts[i]) / len(rows)) for i in order]
        out.append((float(on_pair[:, h].median()), float(on_pair[:, h].quantile(0.1)), share))
    return out


@torch.no_grad()
def probe_run(run_dir, length: int | None = None, *, n_examples: int = 64, batch_size: int = 16,
              checkpoint=None, device: str = "auto") -> dict:
    """Probe a trained ``icr`` run at ``length`` tokens (default: its training length) on the
    examples ``ovqflex eval`` measures there. Returns ``{"length", "accuracy" (first value token
    of each query), "queries", "heads": [HeadProbe as dict], "not_probed": [(layer, mixer)]}``."""
    check_counts(n_examples, batch_size)
    cfg, task, model, step = load_run(run_dir, checkpoint, device)
    task = task.evaluation()
    if not isinstance(task, ICR):
        raise ValueError(f"ovqflex probe reads runs of the icr task, got task {task.name!r}")
    length = cfg.seq_len if length is None else length
    check_lengths(task, [length], "probe length")
    dev = next(model.parameters()).device
    inputs: dict[int, Tensor] = {}
    hooks = [block.mixer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, block in enumerate(model.blocks)]
    stats: dict[int, list[Tensor]] = {}
    queries, correct = [], 0
    try:
        for x, y in eval_batches(task, length, n_examples=n_examples, batch_size=batch_size, seed=cfg.seed):
            logits, _ = forward_loss(model, x.to(dev), y.to(dev), None)
            q = recall_queries(x, y, task.key_len)
            correct += int((logits.argmax(-1).cpu()[q[:, 0], q[:, 1]] == y[q[:, 0], q[:, 1]]).sum())
            for i, block in enumerate(model.blocks):
                w = layer_attention(block.mixer, inputs[i], q[:, :2])
                if w is not None:
                    stats.setdefault(i, []).append(w.cpu())  # [Q, H, T]
            queries.append(q)
    finally:
        for h in hooks:
            h.remove()
    key_start = torch.cat(queries)[:, 2]
    heads = []
    for i, rows in stats.items():
        for h, (median, q10, share) in enumerate(pair_statistics(torch.cat(rows), key_start, task._pair_len())):
            heads.append(asdict(HeadProbe(i, model.blocks[i].mixer_name, h, median, q10, share)))
    return {"run": str(run_dir), "step": step, "pattern": model.config.pattern, "length": length,
            "accuracy": correct / max(len(key_start), 1), "queries": len(key_start), "heads": heads,
            "not_probed": [(i, b.mixer_name) for i, b in enumerate(model.blocks) if i not in stats]}
