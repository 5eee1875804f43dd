"""The near-tie rule's helper (tests/helpers.py::reference_on_routes): it accepts routes that differ
from the loop's only at near-ties and refuses any other difference. The fused op taking the other
side of real ties: tests/ovqflex/ops/test_ovq.py::test_a_tie_may_go_either_way."""
import pytest
import torch

from recurrences.reference import ovq_attention_reference, vq_attention_reference
from tests.helpers import reference_on_routes
# test_first_seeding_and_new_centroids_by_hand's keys: chunk 0 seeds slots 0..3 with e1, then by
# similarity to it -e1 (-1), e2 and -e2 (0 each: a tie, the lower index first)
from tests.recurrences.test_ovq_reference import BY_HAND_KEYS as KEYS
from tests.recurrences.test_ovq_reference import BY_HAND_ROUTES as OWN


def _run(**forced):
    k = torch.tensor(KEYS).view(1, 1, 12, 3)
    q, v = torch.randn(1, 1, 12, 3, generator=torch.Generator().manual_seed(0)), k.flip(-1)
    return ovq_attention_reference(q, k, v, torch.ones(1), chunk_size=4, max_centroids=5, growth="full", **forced)


def _routes(r):
    return torch.tensor(r).view(1, 1, 12)


def test_the_loops_own_routes_give_its_own_run():
    own = _run()
    assert own.routes[0, 0].tolist() == OWN
    same = reference_on_routes(_run, routes=own.routes)
    assert torch.equal(same.routes, own.routes) and torch.equal(same.out, own.out) and (same.gaps == 0).all()


def test_a_tie_gives_the_run_forced_onto_the_other_routes():
    """e2 and -e2 tie for slot 2: founding it with -e2 instead swaps the contents of slots 2 and 3,
    and every later decision is the loop's on that history with the two labels swapped."""
    swapped = [{2: 3, 3: 2}.get(r, r) for r in OWN]
    forced = reference_on_routes(_run, routes=_routes(swapped))
    assert forced.routes[0, 0].tolist() == swapped and (forced.gaps == 0).all()
    torch.testing.assert_close(forced.out, _run().out)  # a relabelling: the same dictionary, the same outputs


def test_any_other_difference_is_refused_with_its_gap():
    wrong = OWN[:4] + [2] + OWN[5:]  # e1 merged into e2's slot: 1 - 0 short of the best
    with pytest.raises(AssertionError, match=r"\(1 routes; the first at \{'routes': \[0, 0, 4\]\}\), and not at "
                                             r"near-ties: on the fused decisions' history the one at \[0, 0, 4\] "
                                             r"falls 1\.000e\+00 short"):
        reference_on_routes(_run, routes=_routes(wrong))


def test_codes_too():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    codebook = torch.randn(2, 6, 8, generator=g)
    run = lambda **forced: vq_attention_reference(q, k, v, codebook, torch.ones(2), chunk_size=4, **forced)  # noqa
    own = run()
    same = reference_on_routes(run, codes=own.codes)
    assert torch.equal(same.codes, own.codes) and torch.equal(same.out, own.out)
    with pytest.raises(AssertionError, match=r"\(40 codes; the first at \{.codes.: \[0, 0, 0\]\}\)"):
        reference_on_routes(run, codes=(own.codes + 1) % 6)
