"""Sequential reference of Key-Value Means attention (KVM paper, arXiv 2605.09877, §4 and appendix A).

The test oracle for the fused program: the paper's chunk loop, written plainly
and independently of :mod:`recurrences.kvm` (its own budget arithmetic, one-hot
matmul merges as in the paper's pseudo-code, explicit softmax per query chunk).
One Python iteration per query chunk, vectorized over batch and heads.

1. The first ``min(T, Nb*C)`` tokens: causal attention over tokens, keys x ``tau_bswa``.
2. Query chunk ``[qs, qe)``: ``b = roundup(qe, C) - Nb*C``; attend to
   ``[tau_state * LN_s(s_k) ; tau_bswa * k[b:qe]]`` with values ``[readout(s_v) ; v[b:qe]]``,
   causal on the window, softmax scale ``1/sqrt(d)``.
3. Then the overflow block ``[b, b+C)`` updates the state: append the least-redundant
   tokens (budget), merge the rest into ``argmax_{i >= sink_len}`` of the post-append state.

Autograd flows through the loop (q, k, v, gate, ``LN_s``, temperatures); routing
decisions use a float32 no-grad copy of the key sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVMReferenceResult:
    out: torch.Tensor       # [B, H, T, Dv], dtype of q
    routes: torch.Tensor    # [B, H, T] int64 state row of each absorbed token, -1 otherwise
    founder: torch.Tensor   # [B, H, T] bool, the token created its row (initial or appended)
    sizes: list[int]        # sizes[c]: state rows query chunk c read (0 in the front)
    state_k: torch.Tensor   # [B, H, m, D] final key sums (after the last update made)
    state_v: torch.Tensor   # [B, H, m, Dv] final value sums
    radii: torch.Tensor     # [B, H, m] value radius of each row
    gaps: torch.Tensor      # [B, H, T] float32, how far each decision falls short of the loop's own (0: its own)


def _budget_rows(ctx: int, C: int, budget: str, state_min_len, f, e, round_down, sat_n) -> int:
    """The paper's B(e): constant, power law or saturating, rounded down, at least the minimum."""
    if budget == "fixed":
        return C if state_min_len is None else state_min_len
    if budget == "power_law":
        raw = math.floor(f * ctx ** e)
    elif budget == "saturation":
        raw = (sat_n * ctx) // (sat_n + ctx)
    else:
        raise ValueError(f"budget must be 'fixed', 'power_law' or 'saturation', got {budget!r}")
    raw -= raw % round_down
    return max(raw, state_min_len or 0)


def _ln(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _scale(kbar_block: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The largest similarity a block's tokens [B,H,C,D] can have with the ``LN_s`` state rows
    [B,H,m,D] (Cauchy-Schwarz: largest key norm x largest row norm) [B,H,1]: the unit of KVM's gaps,
    so that they read like cosine gaps whatever the scale of ``LN_s``."""
    return (kbar_block.norm(dim=-1).amax(-1) * rows.norm(dim=-1).amax(-1)).clamp_min(1e-30)[..., None]


def _append_gaps(score: torch.Tensor, app_mask: torch.Tensor, n_app: int) -> torch.Tensor:
    """Gaps of forced appends [B,H,C]: the loop appends the ``n_app`` tokens with the lowest ``score``
    (best similarity to the state); the forced set's ``i``-th lowest score is compared with the loop's
    ``i``-th lowest, and the distance given to that token (0 on tokens not appended)."""
    own = score.sort(dim=-1, stable=True).values[..., :n_app]
    forced, idx = torch.where(app_mask, score, torch.inf).sort(dim=-1, stable=True)
    return torch.zeros_like(score).scatter(2, idx[..., :n_app], (forced[..., :n_app] - own).abs())


def kvm_attention_reference(q, k, v, gate=None, *, ln_s_weight, ln_s_bias, tau_state=None, tau_bswa=None,
                            chunk_size: int = 128, n_bswa_chunks: int = 2, sink_len: int = 1,
                            rope_dims: int | None = None, budget: str = "fixed", state_min_len: int | None = None,
                            growth_factor: float = 16.0, growth_exponent: float = 0.5, round_down: int = 1,
                            saturation_n: int = 1024, max_state_chunks: int | None = 1, use_vlens: bool = True,
                            ln_eps: float = 1e-5, norm_eps: float = 1e-12,
                            routes: torch.Tensor | None = None, founder: torch.Tensor | None = None
                            ) -> KVMReferenceResult:
    """KVM attention by the paper's loop. q, k ``[B, H, T, D]`` (normalized and rotated), v
    ``[B, H, T, Dv]``, gate ``[B, H, T]`` (None: 1), ``ln_s_*`` ``[D]``, ``tau_*`` ``[H]`` (None: 1).
    ``routes`` ([B, H, T] int64) and ``founder`` ([B, H, T] bool), e.g. the fused path's, force the
    append/merge decisions together (a token merged into a row appended in its own block has a new
    row's id too, so the routes alone do not say which tokens were appended): in each overflow block
    the founders are appended, in temporal order as rows ``m, m+1, ...``, and the others merged into
    their given row; ``gaps`` [B, H, T] then says how far each forced decision falls short of the
    loop's own on the same history, in units of the block's largest possible similarity (``_scale``;
    0 for the loop's own routes): an append by the distance of its rank's score to the loop's
    (``_append_gaps``), a merge by the best row's similarity minus its row's.
    """
    B, H, T, D = q.shape
    Dv, C, Nb, dev = v.shape[-1], chunk_size, n_bswa_chunks, q.device
    if isinstance(sink_len, bool) or not isinstance(sink_len, int) or not 0 <= sink_len < C:
        raise ValueError(f"sink_len must be an int in [0, chunk_size={C}) (sinks are rows of the initial state, "
                         f"the first chunk), got {sink_len!r}")
    r = D // 2 if rope_dims is None else rope_dims
    cdt = torch.promote_types(q.dtype, torch.float32)
    qq, kk, vv = q.to(cdt), k.to(cdt), v.to(cdt)
    gg = torch.ones(B, H, T, dtype=cdt, device=dev) if gate is None else gate.to(cdt)
    w, b = ln_s_weight.to(cdt), ln_s_bias.to(cdt)
    t_s = torch.ones(H, dtype=cdt, device=dev) if tau_state is None else tau_state.to(cdt)
    t_b = torch.ones(H, dtype=cdt, device=dev) if tau_bswa is None else tau_bswa.to(cdt)
    scale = 1.0 / math.sqrt(D)

    zero_rope = torch.cat([torch.zeros(r, dtype=cdt, device=dev), torch.ones(D - r, dtype=cdt, device=dev)])
    kbar = _ln(kk * zero_rope, w, b, ln_eps)                       # memory keys, differentiable
    kbar_r = _ln(k.detach().float() * zero_rope.float(), w.detach().float(), b.detach().float(), ln_eps)
    wr, br = w.detach().float(), b.detach().float()
    k_win = kk * t_b.view(1, H, 1, 1)

    if (routes is None) != (founder is None):
        raise ValueError("routes and founder force the decisions together: give both or neither, got "
                         f"{'routes' if founder is None else 'founder'} alone")
    for name, x, dt in (("routes", routes, torch.int64), ("founder", founder, torch.bool)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.dtype != dt or x.shape != (B, H, T)):
            raise ValueError(f"{name} must be a {dt} tensor of shape [B, H, T]={(B, H, T)}, got "
                             + (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
    out_routes = torch.full((B, H, T), -1, dtype=torch.long, device=dev)
    out_founder = torch.zeros(B, H, T, dtype=torch.bool, device=dev)
    gaps = torch.zeros(B, H, T, dtype=torch.float32, device=dev)
    L0 = min(T, Nb * C)
    causal = torch.ones(L0, L0, dtype=torch.bool, device=dev).tril()
    s = torch.einsum("bhid,bhjd->bhij", qq[:, :, :L0], k_win[:, :, :L0]) * scale
    outs = [s.masked_fill(~causal, float("-inf")).softmax(-1) @ vv[:, :, :L0]]
    sizes = [0] * -(-L0 // C)
    s_k, s_v, r_k, radii = kbar.new_zeros(B, H, 0, D), vv.new_zeros(B, H, 0, Dv), kbar_r[:, :, :0], vv.new_zeros(B, H, 0)
    if T > L0:
        s_k, s_v = kbar[:, :, :C], vv[:, :, :C]
        radii = vv[:, :, :C].norm(dim=-1)
        counts = torch.ones(B, H, C, dtype=cdt, device=dev)
        r_k = kbar_r[:, :, :C].clone()                                # routing copy: fp32 sums, no grad
        out_routes[:, :, :C] = torch.arange(C, device=dev)
        out_founder[:, :, :C] = True
    cap = math.inf if max_state_chunks is None else C * max_state_chunks
    for qs in range(L0, T, C):
        qe = min(qs + C, T)
        bw = -(-qe // C) * C - Nb * C                                 # window begins; state covers [0, bw)
        m = s_k.shape[2]
        sizes.append(m)
        # readout and attention of this query chunk
        sk_hat = _ln(s_k, w, b, ln_eps) * t_s.view(1, H, 1, 1)
        if use_vlens:
            sv_hat = radii[..., None] * s_v / s_v.norm(dim=-1, keepdim=True).clamp_min(norm_eps)
        else:
            sv_hat = s_v / counts[..., None]
        keys = torch.cat([sk_hat, k_win[:, :, bw:qe]], dim=2)
        vals = torch.cat([sv_hat, vv[:, :, bw:qe]], dim=2)
        pos_q = torch.arange(qs, qe, device=dev)[:, None]
        pos_w = torch.arange(bw, qe, device=dev)[None, :]
        visible = torch.cat([torch.ones(qe - qs, m, dtype=torch.bool, device=dev), pos_w <= pos_q], dim=1)
        s = torch.einsum("bhid,bhjd->bhij", qq[:, :, qs:qe], keys) * scale
        outs.append(s.masked_fill(~visible, float("-inf")).softmax(-1) @ vals)
        if qe >= T:
            break
        # the overflow block [bw, bw + C) leaves the window: append, then merge
        ob = slice(bw, bw + C)
        target = max(m, min(_budget_rows(qe, C, budget, state_min_len, growth_factor, growth_exponent,
                                         round_down, saturation_n), bw + C, cap))
        n_app = min(target - m, C)
        with torch.no_grad():
            rows_ln = _ln(r_k, wr, br, ln_eps)                                 # the state's routing rows
            score = (kbar_r[:, :, ob] @ rows_ln.transpose(-1, -2)).max(-1).values  # [B,H,C]
        if routes is not None:
            forced, app_mask = routes[:, :, ob].to(dev), founder[:, :, ob].to(dev)
            if (app_mask.sum(-1) != n_app).any():
                raise ValueError(f"founder: block [{bw}, {bw + C}) must append exactly {n_app} tokens")
            if (app_mask & (forced != m + app_mask.cumsum(-1) - 1)).any():
                raise ValueError(f"routes: the founders of block [{bw}, {bw + C}) must have rows {m}.. "
                                 "in temporal order")
            chosen = torch.sort(torch.where(app_mask, torch.arange(C, device=dev), C), dim=-1).values[..., :n_app]
            gaps[:, :, ob] = _append_gaps(score, app_mask, n_app) / _scale(kbar_r[:, :, ob], rows_ln)
        else:
            chosen = torch.sort(torch.argsort(score, dim=-1, stable=True)[..., :n_app], dim=-1).values
        app_mask = torch.zeros(B, H, C, dtype=torch.bool, device=dev).scatter(2, chosen, True)
        pick = lambda x: x[:, :, ob].gather(2, chosen[..., None].expand(B, H, n_app, x.shape[-1]))  # noqa: E731
        s_k, s_v, r_k = torch.cat([s_k, pick(kbar)], 2), torch.cat([s_v, pick(vv)], 2), torch.cat([r_k, pick(kbar_r)], 2)
        radii = torch.cat([radii, pick(vv).norm(dim=-1)], 2)
        counts = torch.cat([counts, torch.ones(B, H, n_app, dtype=cdt, device=dev)], 2)
        m2 = m + n_app
        g = gg[:, :, ob]
        with torch.no_grad():
            # (g kbar) . LN_s(s+), the gate applied to the products: the same argmax (KVM paper §4)
            rows_ln = _ln(r_k, wr, br, ln_eps)                                 # after the append
            sim = kbar_r[:, :, ob] @ rows_ln.transpose(-1, -2)
            logits = g.detach().float()[..., None] * sim
            logits[..., :sink_len] = float("-inf")
        if routes is not None:
            dest = torch.where(app_mask, 0, forced)
            if ((dest < sink_len) & ~app_mask).any() or (dest >= m2).any():
                raise ValueError(f"routes: block [{bw}, {bw + C}) must merge into rows [{sink_len}, {m2})")
            # the merge's gap, per unit of gate (the gate scales a token's products, not its choice)
            merge_gap = (logits.max(-1).values - logits.gather(-1, dest[..., None]).squeeze(-1)) / (
                g.detach().float().abs() * _scale(kbar_r[:, :, ob], rows_ln)).clamp_min(1e-30)
            gaps[:, :, ob] = torch.where(app_mask, gaps[:, :, ob], merge_gap)
        else:
            dest = logits.argmax(-1)
        onehot = torch.zeros(B, H, C, m2, dtype=cdt, device=dev).scatter(-1, dest[..., None], 1.0)
        onehot = onehot * (~app_mask)[..., None]                      # appended tokens are not merged
        s_k = s_k + onehot.transpose(-1, -2) @ (g[..., None] * kbar[:, :, ob])
        s_v = s_v + onehot.transpose(-1, -2) @ (g[..., None] * vv[:, :, ob])
        r_k = r_k + onehot.float().transpose(-1, -2) @ (g.detach().float()[..., None] * kbar_r[:, :, ob])
        counts = counts + onehot.sum(-2)
        rows = torch.arange(m, m2, device=dev).expand(B, H, n_app)
        out_routes[:, :, ob] = torch.where(app_mask, 0, dest).scatter(2, chosen, rows)
        out_founder[:, :, ob] = app_mask
    out = torch.cat(outs, dim=2)
    return KVMReferenceResult(out=out.to(q.dtype), routes=out_routes, founder=out_founder, sizes=sizes,
                              state_k=s_k, state_v=s_v, radii=radii, gaps=gaps)
