"""The near-tie rule's helper (tests/helpers.py::reference_on_routes): it accepts routes that differ
from the loop's only at near-ties and refuses any other difference."""
import pytest
import torch

import ovqflex
from recurrences.reference import ovq_attention_reference, vq_attention_reference
from tests.helpers import reference_on_routes

KW = dict(chunk_size=16, max_centroids=24)


def _lattice(seed=134):
    """Lattice keys on which the fused OVQ op merges token 21 of head 3 into slot 8, the loop into slot 0
    (an exact tie for the loop; tests/ovqflex/ops/test_ovq.py::test_a_tie_may_go_either_way)."""
    from tests.ovqflex.ops.test_ovq import lattice_inputs
    return [x.detach() for x in lattice_inputs(seed)]


def test_the_loops_own_routes_give_its_own_run():
    q, k, v, beta = _lattice()
    run = lambda **forced: ovq_attention_reference(q, k, v, beta, **KW, **forced)  # noqa: E731
    own = run()
    again = reference_on_routes(run, routes=own.routes)
    assert torch.equal(again.routes, own.routes) and (again.gaps == 0).all()


def test_a_tie_gives_the_run_forced_onto_the_fused_routes():
    q, k, v, beta = _lattice()
    _, state = ovqflex.ovq_attention(q, k, v, beta, backend="blocked", return_state=True, **KW)
    run = lambda **forced: ovq_attention_reference(q, k, v, beta, **KW, **forced)  # noqa: E731
    assert run().routes[0, 3, 21] == 0 and state.routes[0, 3, 21] == 8
    forced = reference_on_routes(run, routes=state.routes)
    assert torch.equal(forced.routes, state.routes) and forced.gaps[0, 3, 21] == 0 and forced.gaps.max() <= 1e-6


def test_any_other_difference_is_refused_with_its_gap():
    q, k, v, beta = _lattice()
    run = lambda **forced: ovq_attention_reference(q, k, v, beta, **KW, **forced)  # noqa: E731
    own = run()
    routes = own.routes.clone()
    t = 40  # a token of chunk 2 merged into an old slot: move it to the old slot least like it
    slot = int(routes[0, 0, t])
    routes[0, 0, t] = 0 if slot != 0 else 1
    with pytest.raises(AssertionError, match=r"1 routes; the first at \{'routes': \[0, 0, 40\]\}\), and not at "
                                             r"near-ties: .* falls \d\.\d{3}e[-+]\d\d short"):
        reference_on_routes(run, routes=routes)


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
