"""Region bounds against their plain definitions (docs/design.md §3.1)."""
import pytest
import torch

from masks.regions import BlockWindow, Causal, Geometry, OwnChunk, Sinks, StateBank, TokenWindow

GEOM = Geometry(q_len=300, q_pad=384, n_state=256, kv_tokens=384, block_q=128, block_kv=128)
S = GEOM.n_state


def visible(region, i, r):
    """Plain-Python definition of each region: can query i see kv row r?"""
    j = r - S
    if isinstance(region, Causal):
        return 0 <= j <= i
    if isinstance(region, TokenWindow):
        return 0 <= j <= i and i - j < region.window
    if isinstance(region, BlockWindow):
        return 0 <= j <= i and j // region.chunk_size > i // region.chunk_size - region.width
    if isinstance(region, Sinks):
        return 0 <= j <= i and j < region.n
    if isinstance(region, StateBank):
        c = min(i // region.chunk_size, region.live.numel() - 1)
        return c * region.rows_per_chunk <= r < c * region.rows_per_chunk + int(region.live[c])
    raise AssertionError(region)


REGIONS = {
    "causal": Causal(),
    "window-1": TokenWindow(1),
    "window-37": TokenWindow(37),
    "bswa-2x32": BlockWindow(2, 32),
    "own-chunk-16": OwnChunk(16),
    "sinks-3": Sinks(3),
    "bank": StateBank(16, 32, torch.tensor([0, 3, 16, 7, 9, 16, 16, 2, 5, 1, 0, 4])),
}


@pytest.mark.parametrize("name", list(REGIONS))
def test_region_matches_definition_and_is_monotone(name):
    region = REGIONS[name]
    p = region.params(GEOM, torch.device("cpu"))
    q = torch.arange(GEOM.q_pad)
    lo, hi = region.bounds(p, q)
    assert (lo[1:] >= lo[:-1]).all() and (hi[1:] >= hi[:-1]).all(), "bounds must be non-decreasing"
    rows = torch.arange(GEOM.kv_len)
    got = region.contains(p, q[:, None], rows[None, :])
    want = torch.tensor([[visible(region, i, r) for r in range(GEOM.kv_len)] for i in range(GEOM.q_pad)])
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TokenWindow(0), "window"),
        (lambda: TokenWindow(-3), "window"),
        (lambda: BlockWindow(0, 32), "width"),
        (lambda: BlockWindow(2, 24), "chunk_size"),
        (lambda: BlockWindow(2, 0), "chunk_size"),
        (lambda: Sinks(0), "n_sinks"),
        (lambda: StateBank(8, 20, torch.tensor([1])), "chunk_size"),
        (lambda: StateBank(8, 32, torch.tensor([])), "live"),
    ],
    ids=["window-0", "window-neg", "bswa-n0", "chunk-24", "chunk-0", "sinks-0", "bank-chunk-20", "bank-empty"],
)
def test_bad_region_parameters_raise(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_region_parameters_are_made_once_per_values_and_device():
    """Eager, a region's Python parameters become one kept int32 tensor per values and device (on a GPU,
    ``torch.tensor`` copies from the host and waits for the device at every call otherwise); a tensor
    first made under ``inference_mode`` is a plain one, usable by a later training forward; compiled, the
    parameters are the graph's own constants and the region's bounds are the eager ones."""
    window = TokenWindow(37)
    first = window.params(GEOM, torch.device("cpu"))[0]
    assert first is window.params(GEOM, torch.device("cpu"))[0] is TokenWindow(37).params(GEOM, "cpu")[0]
    assert first.dtype == torch.int32 and first.tolist() == [S, 37]
    other = Geometry(q_len=300, q_pad=384, n_state=128, kv_tokens=384, block_q=128, block_kv=128)
    assert window.params(other, torch.device("cpu"))[0].tolist() == [128, 37]
    with torch.inference_mode():
        made = TokenWindow(41).params(GEOM, torch.device("cpu"))[0]
    assert not made.is_inference()
    q_idx = torch.arange(GEOM.q_len)

    def bounds(q_idx):
        return TokenWindow.bounds(TokenWindow(41).params(GEOM, q_idx.device), q_idx)

    for got, want in zip(torch.compile(bounds, fullgraph=True)(q_idx), bounds(q_idx)):
        assert torch.equal(got, want)
