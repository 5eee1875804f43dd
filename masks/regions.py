"""Region predicates of an attention program.

Every region is an *interval* of kv rows per query: query ``i`` sees the kv rows
``[lo(i), hi(i))`` of the region, and both ``lo`` and ``hi`` are non-decreasing in
``i``. That single property is what the analytic block-mask builder
(:mod:`masks.blocks`) relies on: over a block of queries ``[qs, qe)`` the rows
some query sees lie in ``[lo(qs), hi(qe-1))`` and the rows every query sees are
``[lo(qe-1), hi(qs))``.

The kv sequence of a program is ``[S state rows ; token rows]`` (docs/design.md §3.1);
token ``j`` lives at kv row ``S + j``. Regions keep their Python parameters (for
the static block structure) and receive them again as small int32 tensors at
trace time (``bounds(p, q_idx)``), so a new window size or state size does not
recompile a FlexAttention graph (docs/design.md §3.5: a Python int a graph reads is a guard).

All ``bounds`` functions use tensor ops only; they work on the scalar index
tensors FlexAttention passes to a ``mask_mod`` and on the broadcast index
tensors of the ``blocked``/``dense`` backends alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from recurrences.checks import check_chunk, check_int
from recurrences.compiling import device_constant, is_symbolic


@dataclass(frozen=True)
class Geometry:
    """Static (Python int) shape facts of one program.

    ``q_len``: real queries T. ``q_pad``: queries padded to ``block_q``.
    ``n_state``: state rows S (token rows start at S). ``kv_tokens``: token rows.
    ``build_program`` makes S and ``kv_tokens`` multiples of ``block_kv``; a program moved to
    larger blocks (``AttentionProgram.on_blocks``) keeps S, so only ``kv_len`` is a multiple there.
    """

    q_len: int
    q_pad: int
    n_state: int
    kv_tokens: int
    block_q: int
    block_kv: int

    @property
    def kv_len(self) -> int:
        return self.n_state + self.kv_tokens

    @property
    def n_q_blocks(self) -> int:
        return self.q_pad // self.block_q

    @property
    def n_kv_blocks(self) -> int:
        return self.kv_len // self.block_kv


class Region:
    """Base class: an interval of kv rows per query (see module doc).

    Subclasses define ``name`` (``"sink" | "state" | "window" | "causal"``),
    ``params`` (int32 tensors captured by the mask_mod), ``bounds`` and
    ``max_span`` (an upper bound, in rows, of ``hi(qe-1) - lo(qs)`` over one
    query block ``[qs, qe)``); ``start_lattice`` tells where ``lo(qs)`` can fall, so that
    ``max_blocks``, the static width of the block lists, counts only the kv blocks such an
    interval can really touch.

    ``exact``: every row of ``[lo, hi)`` is visible. A region with a per-row predicate
    inside its interval (the versioned state layout, :mod:`masks.versioned`) sets it
    False and overrides ``contains``: its blocks are then listed partial, unless ``refine_blocks``
    knows from its predicate that a block is seen whole (listed full) or not at all (not listed).

    ``shared_test``: regions of one state whose rows are visible exactly when one per-row test
    says so (the versioned layout's checkpoints and version rows: the liveness alone decides,
    inside their intervals or not) return the same key, a string (a program has one state, so the
    key names the kind of test); a program's ``mask_mod`` then runs that test once (``test_shared``
    of the first such region) in place of each region's ``contains``.
    """

    name: ClassVar[str] = "region"
    exact: ClassVar[bool] = True
    shared_test: ClassVar[str | None] = None

    def params(self, geom: Geometry, device: torch.device) -> tuple[Tensor, ...]:
        raise NotImplementedError

    @staticmethod
    def bounds(p: tuple[Tensor, ...], q_idx: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def max_span(self, geom: Geometry) -> int:
        raise NotImplementedError

    def start_lattice(self, geom: Geometry) -> tuple[int, int]:
        """``(base, step)``: the first row ``lo(qs)`` of every query block (``qs`` a multiple of
        ``geom.block_q``) is ``base + j step`` for some integer ``j`` (``step = 0``: always ``base``).
        The default ``(0, 1)`` claims nothing."""
        return 0, 1

    def max_blocks(self, geom: Geometry) -> int:
        """The most kv blocks (of ``geom.block_kv`` rows) the rows of one query block can touch: its
        interval of at most ``max_span`` rows, starting where ``start_lattice`` allows
        (:func:`blocks_touched`). The block lists are this wide (at most ``n_kv_blocks``). Static: it reads the
        region's int fields and ``geom``, never its tensors (``masks.blocks.list_width`` relies on it)."""
        return blocks_touched(self.max_span(geom), *self.start_lattice(geom), geom.block_kv)

    def contains(self, p: tuple[Tensor, ...], q_idx: Tensor, kv_idx: Tensor, b: Tensor | None = None,
                 h: Tensor | None = None) -> Tensor:
        """Whether query ``q_idx`` sees kv row ``kv_idx`` (broadcast); ``b, h`` (batch, head
        index tensors of the ``mask_mod``) matter only to regions with per-row predicates."""
        lo, hi = self.bounds(p, q_idx)
        return (kv_idx >= lo) & (kv_idx < hi)

    def test_shared(self, p: tuple[Tensor, ...], q_idx: Tensor, kv_idx: Tensor, b: Tensor | None = None,
                    h: Tensor | None = None) -> Tensor:
        """The shared test: whether query ``q_idx`` sees kv row ``kv_idx`` through any region with this
        region's ``shared_test`` key, for every kv row of the program."""
        raise NotImplementedError

    def refine_blocks(self, p: tuple[Tensor, ...], geom: Geometry, ends: Tensor, cand: Tensor, valid: Tensor,
                      memo: dict) -> tuple[Tensor, Tensor] | None:
        """For a region that is not ``exact``: of its candidate kv blocks ``cand [nQB, width]`` (``valid``: the
        block meets the region's rows of some query of the query block; ``ends [2, nQB]``, each query block's
        first and last query), those some query may see (``listed``, within ``valid``) and those every query
        of the block sees whole, in every batch row and head (``full``, within ``listed``): ``(listed, full)``,
        ``[nQB, width]`` bool, or None (the default): every valid block partial. ``listed`` may hold blocks
        nobody sees (they cost time, not correctness); ``full`` must be exact. ``memo``: one dict per program
        build, for a summary of whole blocks that the regions of one ``shared_test`` compute once."""
        return None


def union_tests(regions, params) -> list:
    """``(test, p)`` pairs whose union is the program's visibility: each region's ``contains``, a
    shared test once for all the regions sharing it."""
    tests, shared = [], set()
    for region, p in zip(regions, params):
        key = region.shared_test
        if key is None:
            tests.append((region.contains, p))
        elif key not in shared:
            shared.add(key)
            tests.append((region.test_shared, p))
    return tests


def touched_chunks(geom: Geometry, chunk_size: int) -> int:
    """The most chunks of ``chunk_size`` tokens one query block touches (query blocks start at multiples of
    ``geom.block_q``): ``block_q / chunk_size`` whole chunks, or 1, when one size divides the other."""
    bq = geom.block_q
    return max(1, bq // chunk_size) if (bq % chunk_size == 0 or chunk_size % bq == 0) else (bq - 1) // chunk_size + 2


def known_multiple(x: int, m: int) -> bool:
    """Whether ``x`` is a multiple of ``m``, provably: a symbolic ``x`` (a size under ``torch.compile``
    with a dynamic length) only where that holds for every value, so the answer adds no guard."""
    return statically_known_true(x % m == 0)


def blocks_touched(span: int, base: int, step: int, block: int) -> int:
    """The most blocks of ``block`` rows (a power of two) an interval of at most ``span`` rows touches
    when it starts at a row ``base + j step`` (``j`` any integer; ``step = 0``: at ``base``).

    Its first row's offset in its block is then ``base mod d`` plus a multiple of ``d = gcd(step,
    block)``, at most ``block - d + base mod d``, and the interval reaches ``ceil((offset + span) /
    block)`` blocks: ``ceil(span / block)`` for an aligned start, at most one more for any start.
    Symbolic ``base`` or ``step`` count only what is provable (:func:`known_multiple`)."""
    d = block
    while d > 1 and not known_multiple(step, d):
        d //= 2
    if is_symbolic(base):  # (dynamo shows a symbol to traced code as an int: isinstance cannot tell)
        offset = 0 if known_multiple(base, d) else d - 1
    else:
        offset = base % d
    return -(-(block - d + offset + span) // block)


def _i32(values: list[int], device: torch.device) -> Tensor:
    """A region's Python parameters as an int32 tensor on ``device`` (read only): eager, one kept tensor
    per values and device (:func:`~recurrences.compiling.device_constant`: no host copy, so no stream
    sync, at every call); compiled, a constant of the graph."""
    if torch.compiler.is_compiling():
        return torch.tensor(values, dtype=torch.int32, device=device)
    return device_constant(tuple(values), torch.int32, torch.device(device))




@dataclass(frozen=True)
class Causal(Region):
    """Token ``j`` visible to query ``i`` iff ``j <= i`` (full causal attention)."""

    name: ClassVar[str] = "causal"

    def params(self, geom, device):
        return (_i32([geom.n_state], device),)

    @staticmethod
    def bounds(p, q_idx):
        (s,) = p
        return s[0] + q_idx * 0, s[0] + q_idx + 1

    def max_span(self, geom):
        return geom.kv_tokens

    def start_lattice(self, geom):
        return geom.n_state, 0


@dataclass(frozen=True)
class TokenWindow(Region):
    """Sliding window of ``window`` tokens: ``i - window < j <= i``."""

    window: int
    name: ClassVar[str] = "window"

    def __post_init__(self):
        check_int("window", self.window)

    def params(self, geom, device):
        return (_i32([geom.n_state, self.window], device),)

    @staticmethod
    def bounds(p, q_idx):
        (t,) = p
        lo = torch.clamp(q_idx - t[1] + 1, min=0)
        return t[0] + lo, t[0] + q_idx + 1

    def max_span(self, geom):
        return self.window + geom.block_q - 1

    def start_lattice(self, geom):
        # lo(qs) - S is 0 or qs - window + 1, qs a multiple of block_q
        return geom.n_state, math.gcd(geom.block_q, self.window - 1)


@dataclass(frozen=True)
class BlockWindow(Region):
    """Block sliding window ``width`` chunks wide: the own chunk and the ``width - 1`` before it, causal.

    Query ``i`` (chunk ``c = i // chunk_size``) sees tokens ``[(c - width + 1) * chunk_size, i]``.
    ``width=1`` is "own chunk causal" (OVQ's window).
    """

    width: int
    chunk_size: int
    name: ClassVar[str] = "window"

    def __post_init__(self):
        check_int("width", self.width)
        check_chunk("chunk_size", self.chunk_size)

    def params(self, geom, device):
        return (_i32([geom.n_state, self.width, self.chunk_size], device),)

    @staticmethod
    def bounds(p, q_idx):
        (t,) = p
        lo = torch.clamp((q_idx // t[2] - t[1] + 1) * t[2], min=0)
        return t[0] + lo, t[0] + q_idx + 1

    def max_span(self, geom):
        # [(c - width + 1) L, qs + bq) for the chunk c of qs: qs lies at most L - gcd(bq, L) rows into it
        bq, L = geom.block_q, self.chunk_size
        return bq + (self.width - 1) * L + L - math.gcd(bq, L)

    def start_lattice(self, geom):
        # lo(qs) - S is 0 or a multiple of L; for chunk-aligned query blocks 0 or qs - (width - 1) L
        bq, L = geom.block_q, self.chunk_size
        return geom.n_state, math.gcd(bq, (self.width - 1) * L) if bq % L == 0 else L


def OwnChunk(chunk_size: int) -> BlockWindow:
    """Causal attention inside the query's own chunk."""
    return BlockWindow(1, chunk_size)


@dataclass(frozen=True)
class Sinks(Region):
    """The first ``n`` tokens, visible to every later query (StreamingLLM), causal."""

    n: int
    name: ClassVar[str] = "sink"

    def __post_init__(self):
        check_int("n_sinks", self.n)

    def params(self, geom, device):
        return (_i32([geom.n_state, self.n], device),)

    @staticmethod
    def bounds(p, q_idx):
        (t,) = p
        return t[0] + q_idx * 0, t[0] + torch.clamp(q_idx + 1, max=t[1])

    def max_span(self, geom):
        return self.n

    def start_lattice(self, geom):
        return geom.n_state, 0


@dataclass(frozen=True, eq=False)
class StateBank(Region):
    """Snapshot state layout (docs/design.md §5): chunk ``c`` reads state rows
    ``[c * rows_per_chunk, c * rows_per_chunk + live[c])``.

    ``live``: ``[n_banks]`` int tensor, the live row count of each chunk's
    snapshot; queries of chunks ``>= n_banks`` (padding) read the last bank.
    """

    rows_per_chunk: int
    chunk_size: int
    live: Tensor
    name: ClassVar[str] = "state"

    def __post_init__(self):
        check_int("rows_per_chunk", self.rows_per_chunk)
        check_chunk("chunk_size", self.chunk_size)
        if self.live.dim() != 1 or self.live.numel() < 1:
            raise ValueError(f"live must be a non-empty 1-D tensor, got shape {tuple(self.live.shape)}")

    def params(self, geom, device):
        return (
            _i32([self.rows_per_chunk, self.chunk_size, self.live.numel() - 1], device),
            self.live.to(device=device, dtype=torch.int32),
        )

    @staticmethod
    def bounds(p, q_idx):
        t, live = p
        c = torch.clamp(q_idx // t[1], max=t[2])
        lo = c * t[0]
        return lo, lo + live[c]

    def max_span(self, geom):
        return touched_chunks(geom, self.chunk_size) * self.rows_per_chunk

    def start_lattice(self, geom):
        return 0, self.rows_per_chunk  # each chunk's rows start at c * rows_per_chunk



def token_visibility(regions, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
    """Which token rows each query sees, at absolute positions and with no state rows:
    q_pos ``[Tq]``, kv_pos ``[S]`` int -> ``[Tq, S]`` bool, the union of the token regions
    (sinks, windows, causal). The decode caches use it to attend over the tokens they keep
    and to drop the ones the next query cannot see: every token region's lower bound
    never decreases with the query, so no later query sees them again."""
    geom = Geometry(q_len=1, q_pad=16, n_state=0, kv_tokens=16, block_q=16, block_kv=16)
    q_idx, kv_idx = q_pos.view(-1, 1), kv_pos.view(1, -1)
    visible = torch.zeros(q_idx.shape[0], kv_idx.shape[1], dtype=torch.bool, device=q_pos.device)
    for region in regions:
        visible = visible | region.contains(region.params(geom, q_pos.device), q_idx, kv_idx)
    return visible
