"""Attention backends: one program, three interchangeable executions (docs/design.md §3.4).

- ``flex``: ``torch.compile(flex_attention, dynamic=False)``, the product path.
  Trains on CUDA; forward-only on CPU in torch 2.13, where it takes fp32, bf16 and fp16 programs
  (``auto`` runs a float64 program on ``blocked``, :func:`flex_takes`).
- ``blocked``: pure PyTorch, differentiable anywhere. Each query block gathers the
  kv blocks its block lists name, applies the same ``mask_mod`` (partial blocks
  only, exactly like flex) and ``score_mod``, softmax, matmul — batched over all
  query blocks. This is how CPU trains.
- ``dense``: the full ``[Q, KV]`` score matrix with the ``mask_mod`` evaluated
  everywhere. Ignores the block lists, so it is the oracle that catches a wrong
  analytic block mask. Small shapes only.

``attend(program, backend="auto")`` returns ``[B, H, q_len, Dv]``.

Flex on CUDA (and every other device that runs flex's Triton kernels) runs a program on
blocks of at least :data:`FLEX_TRITON_MIN_BLOCK` = 128 rows (:func:`flex_block_size`,
``AttentionProgram.on_blocks``). The reasons are in torch's flex lowering
(``torch/_inductor/kernel/flex/``, torch 2.11-2.13):

- the forward kernel skips (or, with one config, refuses: "Q and KV block size must be
  divisible by BLOCK_M and BLOCK_N") every tile config whose ``BLOCK_M``/``BLOCK_N`` does not
  divide the BlockMask's block sizes (``flex_attention.py``); the default tiles reach 128
  (H100: fp32 d64 ``(128, 32)``, bf16 d64 ``(128, 128)``; ``template_heuristics/triton.py``);
- the backward kernel drops every config whose ``BLOCK_M1/N1/M2/N2`` do not divide them,
  *before* user ``kernel_options`` apply, so no kernel option can rescue a small block
  (H100 bf16, 64 <= d <= 128: ``(64, 128, 128, 64)``; pytorch/pytorch#176025 is open, its fix
  #184797 was closed);
- queries shorter than 128 go to the decoding kernel, whose ``BLOCK_M =
  max(next_pow2(Q_LEN * Hq / Hkv), 16)`` must divide the query block (``flex_decoding.py``;
  see pytorch/pytorch#185349).

Every default tile divides 128, and a program padded to 128-row blocks has at least 128
queries, so no ``kernel_options`` are needed. Block sizes are powers of two (checked where
programs are built), so 128 is a multiple of any smaller one. On CPU flex runs the program's
own blocks.

Non-finite inputs (the rule the tests check): with ``dense`` and ``blocked`` an output depends
only on the kv rows its query sees. A query that gives weight to a row whose value has a NaN or
inf gets NaN in every output dim (a visible row's weight is > 0 unless ``exp`` underflows, more
than ~87 below the query's top score); a query that does not see it is unchanged, bit for bit,
whatever that row holds (masked entries get zero weight, and ``0 * nan`` must not leak, so value
rows are split into their finite part and a "non-finite" flag, :func:`split_nonfinite`).
A NaN or inf key reaches exactly the queries that see it through their score. So a NaN at position ``t`` never changes an output
before ``t`` (nor, in a window, past the window). ``flex`` skips kv blocks a query block does
not list but, inside a partially visible block, still multiplies masked values by zero weight:
there a non-finite value reaches every query of each query block that lists its kv block (the
earlier queries of its own block, queries past a window in later blocks), never a query of an
earlier query block.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from masks.program import AttentionProgram
from recurrences.checks import check_choice, host_check_is_free
from recurrences.compiling import narrow_rows, prepare_compile, realize
from recurrences.precision import no_autocast, widened

log = logging.getLogger("ovqflex")

BACKENDS = ("auto", "flex", "blocked", "dense")


#: Smallest BlockMask block flex's Triton kernels get (see the module doc).
FLEX_TRITON_MIN_BLOCK = 128


def flex_block_size(device_type: str, block_size: int) -> int:
    """The BlockMask block size flex runs a program of ``block_size`` blocks with on
    ``device_type``: the program's own on CPU, at least :data:`FLEX_TRITON_MIN_BLOCK` elsewhere."""
    return block_size if device_type == "cpu" else max(block_size, FLEX_TRITON_MIN_BLOCK)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """The compiled flex kernel, shared by every program. Each new shape or region
    structure is a new graph; past dynamo's recompile limit (8 by default) it would
    silently fall back to the unfused eager path, so the limit is raised
    (:func:`recurrences.compiling.prepare_compile`)."""
    prepare_compile()
    return torch.compile(flex_attention, dynamic=False)


def _needs_grad(program: AttentionProgram) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in (program.q, program.k, program.v, program.bias))


#: The program dtypes torch's CPU flex kernel takes (its lowering refuses the others, float64 too).
FLEX_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def flex_takes(dtype: torch.dtype) -> bool:
    """Whether ``backend="auto"`` may give flex a ``dtype`` program: the dtypes its CPU kernel takes
    (:data:`FLEX_CPU_DTYPES`), on every device. A float64 program goes to
    ``blocked``, which computes it in float64 (docs/design.md §2, rule 3): a run in float64 is a
    check of the arithmetic, where speed matters less than the last digits; flex on CUDA in float64
    is torch's to run (an explicit ``backend="flex"``) and not among the dtypes ovqflex tests."""
    return dtype in FLEX_CPU_DTYPES


def flex_trains_on(device: torch.device) -> bool:
    """Whether flex attention has a backward on this device (CUDA: yes; CPU in torch 2.13: no)."""
    return device.type == "cuda"


def training_backend(device: torch.device) -> str:
    """The backend ``auto`` picks on ``device`` when a gradient is needed: ``flex`` where flex
    trains (:func:`flex_trains_on`), else ``blocked``."""
    return "flex" if flex_trains_on(device) else "blocked"


def auto_backend(device: torch.device, dtype: torch.dtype, grad: bool) -> str:
    """The backend ``auto`` picks for a program of ``dtype`` on ``device``: ``flex`` where it can run (no
    gradient needed, or where flex trains; a dtype flex takes, :func:`flex_takes`), else ``blocked``."""
    return (training_backend(device) if grad else "flex") if flex_takes(dtype) else "blocked"


_reported: set[tuple[str, str, bool, torch.dtype]] = set()


def resolve_backend(backend: str, program: AttentionProgram) -> str:
    """``auto`` -> ``flex`` when it can run here (no grad needed, or CUDA; a program dtype flex takes,
    :func:`flex_takes`), else ``blocked``."""
    check_choice("backend", backend, BACKENDS)
    if backend != "auto":
        return backend
    dev, dtype = program.q.device, program.q.dtype
    grad = _needs_grad(program)
    choice = auto_backend(dev, dtype, grad)
    key = (dev.type, choice, grad, dtype)
    if key not in _reported and not torch.compiler.is_compiling():
        _reported.add(key)
        log.info("ovqflex: backend auto -> %s (device %s, grad %s, %s)", choice, dev.type, grad, dtype)
    return choice


def attend(program: AttentionProgram, backend: str = "auto") -> Tensor:
    """Run ``program``; returns ``[B, H, q_len, Dv]`` in the dtype of ``q``. Every backend computes the
    scores and the softmax-weighted sum in fp32 (flex accumulates in fp32; ``blocked`` and ``dense``
    upcast, with autocast off, which would run their matmuls in bf16), a float64 program in float64
    (``blocked`` and ``dense``; ``auto`` takes ``blocked`` for it, :func:`flex_takes`)."""
    backend = resolve_backend(backend, program)
    if backend == "flex" and not program.q.shape[0]:
        # an empty batch: flex's lowering indexes the score_mod's captured [0, ...] tensors and fails
        # (IndexError); blocked returns the empty output, differentiable as any other
        backend = "blocked"
    if backend == "flex":
        out = _flex(program)
    else:
        with no_autocast(program.q):
            out = _blocked(program) if backend == "blocked" else _dense(program)
    return narrow_rows(out, 2, 0, program.q_len)


def _realized_captures(p: AttentionProgram) -> AttentionProgram:
    """Route every captured tensor of the mask_mod/score_mod through an extern identity, so
    inductor sees real buffers (graph inputs or extern outputs), never tensors computed
    in-graph by pointwise ops. On CPU the flex template otherwise rejects the kernel ("No
    choices to select"); on CUDA the lowering fails with "'function' object has no attribute
    'graph'" (a compiled KVM layer's training step; a whole op compiled under no_grad)."""
    params = tuple(tuple(realize(t) for t in ps) for ps in p.params)
    bias = None if p.bias is None else realize(p.bias)
    return dataclasses.replace(p, params=params, bias=bias, _mask_mod=None)


def _flex(p: AttentionProgram) -> Tensor:
    dev = p.q.device
    if _needs_grad(p) and not flex_trains_on(dev):
        raise NotImplementedError(
            f"flex attention has no backward on {dev.type} in this torch; use backend='blocked' (or 'auto')"
        )
    if dev.type == "cpu" and p.q.dtype not in FLEX_CPU_DTYPES:
        raise ValueError(f"backend='flex' on cpu takes a float32, bfloat16 or float16 program (torch's CPU flex "
                         f"kernel), got {p.q.dtype}; use backend='blocked' or 'auto' (which takes blocked for it)")
    p = p.on_blocks(flex_block_size(dev.type, p.geom.block_q))
    compiling = torch.compiler.is_compiling()
    if compiling:
        p = _realized_captures(p)
    bm = p.block_mask(with_q_side=_needs_grad(p))
    fn = flex_attention if compiling else _compiled_flex()
    return fn(p.q, p.k, p.v, score_mod=p.score_mod, block_mask=bm, scale=p.scale)


def split_nonfinite(v: Tensor) -> tuple[Tensor, Tensor]:
    """Value rows ``v [..., S, Dv]`` -> (v with its non-finite entries zeroed ``[..., S, Dv]``,
    ``[..., S]`` bool: the row held a NaN or inf). What the non-finite rule (module docstring) needs
    of a row; a decode cache whose rows do not change stores it once (:func:`attend_rows`'s
    ``v_nonfinite``) instead of paying this pass over its values at every step."""
    finite = torch.isfinite(v)
    return torch.where(finite, v, torch.zeros_like(v)), ~finite.all(dim=-1)


def _flag_nonfinite(v: Tensor) -> Tensor:
    """Value rows ``v [..., S, Dv]`` -> ``[..., S, Dv + 1]``: :func:`split_nonfinite`'s finite part,
    then its flag as a column (1: the row held a NaN or inf). The product with the weights then
    carries, in its last column, the weight a query gives to non-finite rows — one more column of
    the same matmul, no extra pass over the scores."""
    clean, flag = split_nonfinite(v)
    return torch.cat([clean, flag.unsqueeze(-1).to(v.dtype)], dim=-1)


def _softmax_weights(s: Tensor) -> tuple[Tensor, Tensor]:
    """Unnormalised softmax weights of s ``[..., Q, S]`` (``-inf``: not visible) and their row sums
    (1 for a fully masked row, so it gives 0 and no NaN in forward or backward)."""
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    return e, torch.where(denom > 0, denom, torch.ones_like(denom))


def _all_rows(rows: Tensor) -> Tensor:
    return rows


def _safe_softmax_av(s: Tensor, v: Tensor | Sequence[Tensor], pick=None, nonfinite: Tensor | None = None) -> Tensor:
    """softmax(s) @ v ``[..., Q, Dv]`` for s ``[..., Q, S]`` (``-inf``: not visible), v ``[..., S, Dv]``:
    a fully masked row gives 0, a query that gives a non-finite value row weight gets NaN, one
    that does not is untouched (the module docstring's rule). ``pick``: selects the rows s scores
    from v's rows (the blocked backend's per-query-block gather), so v is flagged once per row.
    v may also be a sequence of parts ``[..., S_i, Dv]`` whose rows follow each other along s's
    last axis (``sum S_i = S``): the plain product is then a sum of per-part products, so a decode
    step over a cached state and a few new rows never copies the state into one tensor.

    The rule costs a pass over v (:func:`_flag_nonfinite`). Any non-finite entry of v makes its
    column of ``e @ v`` non-finite for every query (``0 * nan`` and ``0 * inf`` are NaN), so a
    finite plain product proves v finite, and then it is the answer: eager CPU code (decode
    steps over a whole KV cache, the blocked training backend) takes the plain product and pays
    the pass only when the product is not finite. Compiled code, and accelerators (where the
    check would be a host sync), always flag — unless the caller made the pass once already:
    ``nonfinite`` ``[..., S]`` bool gives the flags of v's rows (all parts, in order), whose
    non-finite entries are then zeroed already (:func:`split_nonfinite`, as a static decode cache
    stores its values): the plain product plus the flagged rows' weight (eager CPU: the plain
    product alone while no row is flagged), no pass over v."""
    if pick is None:  # (not `pick or ...`: torch 2.11's dynamo cannot take a function's truth value)
        pick = _all_rows
    parts = list(v) if isinstance(v, (tuple, list)) else [v]
    e, denom = _softmax_weights(s)

    def plain_product() -> Tensor:
        weights = e.split([p.shape[-2] for p in parts], dim=-1) if len(parts) > 1 else (e,)
        out = functools.reduce(torch.add, (torch.matmul(w.to(p.dtype), pick(p)) for w, p in zip(weights, parts)))
        return out / denom.to(out.dtype)

    if nonfinite is not None:
        out = plain_product()
        if host_check_is_free(parts[0]) and not bool(nonfinite.any()):
            return out
        bad_weight = torch.matmul(e, pick(nonfinite.unsqueeze(-1).to(e.dtype)))
        return torch.where(bad_weight > 0, torch.full_like(out, float("nan")), out)
    if host_check_is_free(parts[0]):
        out = plain_product()
        if bool(torch.isfinite(out).all()):
            return out
    v = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    out = torch.matmul(e.to(v.dtype), pick(_flag_nonfinite(v)))
    out, bad_weight = out[..., :-1], out[..., -1:]
    out = out / denom.to(out.dtype)
    return torch.where(bad_weight > 0, torch.full_like(out, float("nan")), out)


def _index_grid(B: int, H: int, dev) -> tuple[Tensor, Tensor]:
    b = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1, 1)
    return b, h


def _blocked(p: AttentionProgram) -> Tensor:
    g = p.geom
    B, H, Qp, D = p.q.shape
    Dv = p.v.shape[-1]
    bq, bk, nqb = g.block_q, g.block_kv, g.n_q_blocks
    dev = p.q.device
    idx, valid, full = p.layout.entries()  # [nqb, W]
    W = idx.shape[-1]
    # kv rows gathered per query block: [nqb, W*bk]
    rows = (idx[:, :, None] * bk + torch.arange(bk, device=dev)).reshape(nqb, W * bk)
    row_valid = valid[:, :, None].expand(nqb, W, bk).reshape(nqb, W * bk)
    row_full = full[:, :, None].expand(nqb, W, bk).reshape(nqb, W * bk)
    kg = widened(p.k[:, :, rows])  # [B, H, nqb, W*bk, D]
    qb = widened(p.q.view(B, H, nqb, bq, D))
    s = torch.matmul(qb, kg.transpose(-1, -2)) * p.scale  # [B, H, nqb, bq, W*bk] fp32 (as flex's) or fp64
    q_idx = torch.arange(Qp, device=dev).view(1, 1, nqb, bq, 1)
    kv_idx = rows.view(1, 1, nqb, 1, W * bk)
    b, h = _index_grid(B, H, dev)
    if p.score_mod is not None:
        s = p.score_mod(s, b, h, q_idx, kv_idx)
    visible = row_valid[:, None, :] & (row_full[:, None, :] | p.mask_mod(b, h, q_idx, kv_idx))
    s = torch.where(visible, s, float("-inf"))
    out = _safe_softmax_av(s, widened(p.v), pick=lambda v: v[:, :, rows])  # [B, H, nqb, bq, Dv]
    return out.reshape(B, H, Qp, Dv).to(p.q.dtype)


def _dense(p: AttentionProgram) -> Tensor:
    B, H, Qp, _ = p.q.shape
    KV = p.k.shape[2]
    dev = p.q.device
    s = torch.matmul(widened(p.q), widened(p.k).transpose(-1, -2)) * p.scale  # [B, H, Qp, KV] fp32 or fp64
    q_idx = torch.arange(Qp, device=dev).view(1, 1, Qp, 1)
    kv_idx = torch.arange(KV, device=dev).view(1, 1, 1, KV)
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    if p.score_mod is not None:
        s = p.score_mod(s, b, h, q_idx, kv_idx)
    s = torch.where(p.mask_mod(b, h, q_idx, kv_idx), s, float("-inf"))
    return _safe_softmax_av(s, widened(p.v)).to(p.q.dtype)


def attend_rows(q: Tensor, k: Tensor | Sequence[Tensor], v: Tensor | Sequence[Tensor], visible: Tensor, *,
                scale: float, bias: Tensor | None = None, v_nonfinite: Tensor | None = None) -> Tensor:
    """Attention of a few queries over explicit kv rows (the decode path of the caches).

    q ``[B, H, Tq, D]``, k ``[B, H, S, D]``, v ``[B, H, S, Dv]``, visible ``[Tq, S]`` bool
    (or broadcastable to ``[B, H, Tq, S]``), bias ``[B, H, S]`` fp32 -> ``[B, H, Tq, Dv]`` in
    q's dtype. Softmax in fp32 (fp64 for fp64 q), as the ``dense`` and ``blocked`` backends. k and v may be
    sequences of parts (``[B, H, S_i, *]``, the same split for both, rows in that order): a
    decode step reads a cached state and its few newest rows without concatenating them.
    ``v_nonfinite`` ``[B, H, S]`` bool: v's rows were stored by :func:`split_nonfinite` (non-finite
    entries zeroed), these are their flags; the step then makes no pass over v for the non-finite
    rule (module docstring), which otherwise copies every value row at every compiled step.
    """
    ks = list(k) if isinstance(k, (tuple, list)) else [k]
    vs = list(v) if isinstance(v, (tuple, list)) else [v]
    if [t.shape[-2] for t in ks] != [t.shape[-2] for t in vs]:
        raise ValueError(f"k and v parts must have the same rows, got {[t.shape[-2] for t in ks]} and "
                         f"{[t.shape[-2] for t in vs]}")
    with no_autocast(q):  # fp32 (or fp64) scores and sums, as the backends'
        qf = widened(q)
        s = torch.cat([torch.matmul(qf, t.to(qf.dtype).transpose(-1, -2)) for t in ks], dim=-1) * scale
        if bias is not None:
            s = s + bias[:, :, None, :].to(s.dtype)
        s = torch.where(visible, s, float("-inf"))
        return _safe_softmax_av(s, [t.to(qf.dtype) for t in vs], nonfinite=v_nonfinite).to(q.dtype)
