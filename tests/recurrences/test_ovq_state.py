"""The snapshot builder: rows are means of what was routed before, counts are histograms."""
import pytest
import torch

from recurrences.ovq import DictionarySchedule, build_ovq_snapshots, dictionary_sizes, route_ovq


def test_snapshot_rows_are_means_and_counts_are_histograms():
    B, H, T, D, L, N = 2, 3, 250, 8, 32, 20
    k = torch.nn.functional.normalize(torch.randn(B, H, T, D), dim=-1)
    v = torch.randn(B, H, T, 5)
    schedule = DictionarySchedule(L, N)
    sizes = dictionary_sizes(-(-T // L), L, N)
    routes = route_ovq(k, schedule=schedule)
    snap = build_ovq_snapshots(k, v, routes, schedule=schedule)
    for c in range(-(-T // L)):
        for b in range(B):
            for h in range(H):
                r = routes[b, h, : c * L]
                for slot in range(sizes[c]):
                    sel = r == slot
                    assert snap.counts[b, h, c, slot] == sel.sum()
                    assert torch.allclose(snap.keys[b, h, c, slot], k[b, h, : c * L][sel].mean(0), atol=1e-6)
                    assert torch.allclose(snap.values[b, h, c, slot], v[b, h, : c * L][sel].mean(0), atol=1e-6)
                assert (snap.counts[b, h, c, sizes[c]:] == 0).all()
    assert snap.live.tolist() == sizes[:-1]


def test_every_live_slot_has_a_token_and_partial_chunk_is_unrouted():
    k = torch.nn.functional.normalize(torch.randn(1, 2, 100, 16), dim=-1)
    sizes = dictionary_sizes(4, 32, 1000, "full")
    routes = route_ovq(k, schedule=DictionarySchedule(32, 1000, "full"))
    assert (routes[..., 96:] == -1).all()
    for h in range(2):
        assert set(routes[0, h, :96].tolist()) == set(range(sizes[3]))


def test_schedules():
    assert dictionary_sizes(3, 16, 4) == [0, 16 * 4 // 20, 32 * 4 // 36, 48 * 4 // 52]
    assert dictionary_sizes(3, 16, 20, "full") == [0, 16, 20, 20]
    assert dictionary_sizes(4, 16, 64, "linear", 256) == [0, 4, 8, 12, 16]


@pytest.mark.parametrize("growth,horizon", [("plateau", None), ("full", None), ("linear", 256)],
                         ids=["plateau", "full", "linear"])
def test_schedule_sizes_of_a_tensor_and_rows_match_the_list(growth, horizon):
    """The closed form the ops evaluate on a tensor of chunk indices (and under a symbolic length) is
    the list's; ``rows(n)`` is the largest size chunks ``0..n-1`` read."""
    schedule = DictionarySchedule(16, 40, growth, horizon)
    sizes = schedule.sizes(30)
    assert schedule.size(torch.arange(31)).tolist() == sizes
    assert schedule.live(30, "cpu").tolist() == sizes[:-1]
    assert [schedule.rows(n) for n in range(1, 31)] == [max(sizes[:n]) for n in range(1, 31)]


def test_schedule_refuses_an_unknown_growth():
    with pytest.raises(ValueError, match="growth must be one of"):
        DictionarySchedule(16, 40, "cubic")
