"""VQAttention layer: codebook training (EMA, DiVeQ), compilation, the aux loss in HybridLM
(the op: tests/ovqflex/ops/test_vq.py)."""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ovqflex
from ovqflex.layers.vq import VQCodebook
from recurrences.reference import vq_attention_reference
from tests.helpers import (FWD_TOL, assert_close, assert_parameter_gradients_match, assert_trains_compiled_once,
                           perturbed)
from tests.ovqflex.conformance import drawn_output


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("estimator", ["ste", "diveq"])
def test_layer_equals_the_reference_on_its_projections(estimator, mode):
    """The layer is its projections, VQ-attention's quadratic form over them with the layer's codebook, local bias
    (away from 0) and (DiVeQ) codes' no-use penalty, and the output projection: forward and the gradient of every
    parameter. A training forward attends with the codebook as it was before the forward updates it. Where
    queries read chunks through the codebook state (80 tokens, 5 chunks) a key gets its code's mean gradient
    (``ovqflex.vq_attention``'s rule): the parameters before the quantized keys (the qkv projection, DiVeQ's
    codebook) are compared at 32 tokens (2 chunks), where every query reads the keys as tokens."""
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, local_bias=True, estimator=estimator,
                                backend="blocked").train(mode == "train")
    with torch.no_grad():
        layer.local_bias.add_(torch.randn(2))
        if estimator == "diveq":
            layer.quantizer.idle_steps.copy_(torch.randint(0, 50, layer.quantizer.idle_steps.shape))
    for T in (80, 32):
        x = torch.randn(2, T, 32)
        codebook, code_bias = layer.quantizer.codebook, layer.quantizer.code_bias()
        if mode == "train":  # the reference reads the state before the forward's update
            codebook, code_bias = codebook.clone(), None if code_bias is None else code_bias.clone()
        q, k, v = layer.split_heads(x)
        ref = layer.merge(vq_attention_reference(q, k, v, codebook, layer.beta, chunk_size=16,
                                                 local_bias=layer.local_bias, estimator=estimator,
                                                 code_bias=code_bias).out)
        out = layer(x)
        assert_close(out, ref, FWD_TOL[torch.float32], f"forward, T={T}")
        before_keys = ("qkv_proj", "quantizer") if T > 32 else ()
        assert_parameter_gradients_match(layer, out, ref, skip=before_keys, may_vanish=("local_bias",) if T == 32
                                         else (), what=f"T={T}: ")


def test_layer_ema_mode_updates_codebook_in_train_only_and_returns_aux():
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, backend="blocked")
    assert torch.allclose(layer.beta, torch.full((2,), 4.0))
    assert "codebook" in dict(layer.named_buffers(prefix="")) or "quantizer.codebook" in dict(layer.named_buffers())
    x = torch.randn(2, 64, 32)
    before = layer.quantizer.codebook.clone()
    y, aux = layer(x, return_aux=True)
    assert y.shape == x.shape
    assert {"loss", "commitment", "usage", "perplexity", "unused_codes", "dead_codes", "rel_quant_error"} <= set(aux)
    assert [name for name, value in aux.items() if value.requires_grad] == ["loss"]  # the metrics are detached
    assert not torch.allclose(layer.quantizer.codebook, before), "training forward must update the codebook"
    assert torch.allclose(layer.quantizer.codebook.norm(dim=-1), torch.ones(2, 8), atol=1e-5)
    layer.eval()
    frozen = layer.quantizer.codebook.clone()
    layer(x)
    assert torch.equal(layer.quantizer.codebook, frozen), "eval forward must not touch the codebook"


def test_initial_values_and_repr():
    """beta starts at sqrt(head_dim), the local bias (when asked for) at 0, so a new layer with it attends as one
    without."""
    with_bias = ovqflex.VQAttention(32, 2, head_dim=8, chunk_size=16, local_bias=True, backend="blocked")
    assert torch.equal(with_bias.beta, torch.full((2,), 8**0.5)) and torch.equal(with_bias.local_bias, torch.zeros(2))
    assert with_bias.extra_repr() == ("hidden_size=32, num_heads=2, head_dim=8, chunk_size=16, local_bias=True, "
                                      "backend='blocked'")
    plain = ovqflex.VQAttention(32, 2, chunk_size=16)
    assert plain.local_bias is None and "local_bias=False, backend='auto'" in plain.extra_repr()


def test_the_drawn_program_carries_the_codes_no_use_bonus():
    """``program(x)`` (what ``ovqflex viz`` draws) of a DiVeQ layer whose codes have idle steps: attended and
    projected out, the layer's forward. The conformance check of the same (``tests/ovqflex/conformance.py``) runs
    the method's test layer, an EMA codebook without such a bonus."""
    torch.manual_seed(0)
    layer = perturbed(ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, estimator="diveq",
                                          backend="blocked")).eval()
    assert layer.quantizer.idle_steps.max() > 0  # (perturbed: idle codes)
    with torch.no_grad():
        x = torch.randn(2, 80, 32)
        drawn = drawn_output(layer, x)
        assert_close(drawn, layer(x), FWD_TOL[torch.float32], "the drawn program")
        layer.quantizer.idle_steps.zero_()  # (the bonus matters here)
        assert not torch.allclose(layer(x), drawn, atol=1e-3)


@pytest.mark.parametrize("estimator", ["ste", "diveq"])
def test_an_empty_batch_leaves_the_codebook_state_as_it_was(estimator):
    """No keys, nothing observed: neither the EMA decay nor a revival (which had drawn a key from none:
    ``random_ expects 'from' to be less than 'to'``) nor an idle step."""
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, estimator=estimator, backend="blocked")
    layer(torch.randn(2, 64, 32))  # some state to keep
    before = {name: b.clone() for name, b in layer.quantizer.named_buffers()}
    before["codebook"] = layer.quantizer.codebook.detach().clone()
    y, aux = layer(torch.randn(0, 64, 32), return_aux=True)
    assert y.shape == (0, 64, 32)
    for name, was in before.items():
        assert torch.equal(getattr(layer.quantizer, name), was), name


def test_layer_bad_codebook_size_and_ema_decay():
    with pytest.raises(ValueError, match="codebook_size must be >= 1, got 0"):
        ovqflex.VQAttention(32, 2, codebook_size=0)
    with pytest.raises(ValueError, match="ema_decay must be < 1, got 1.0"):  # an EMA that never moves
        ovqflex.VQAttention(32, 2, ema_decay=1.0)
    for name, bad in (("ema_decay", -0.5), ("dead_threshold", -0.1), ("penalty_rate", -1.0), ("dead_after", 0)):
        with pytest.raises(ValueError, match=f"{name} must be .*, got {bad}"):
            VQCodebook(2, 8, 16, **{name: bad})


def test_dead_codes_and_the_no_use_penalty_follow_their_thresholds():
    """``ste``: a code is dead below ``dead_threshold`` (at it, alive); ``diveq``: after ``dead_after`` idle
    steps (at it, dead), and its assignment bonus is ``penalty_rate`` per idle step."""
    ste = VQCodebook(1, 4, 8, dead_threshold=0.01)
    ste.ema_counts.copy_(torch.tensor([[0.01, 0.0099, 1.0, 0.0]]))
    assert ste.dead_codes() == 2 and ste.code_bias() is None
    diveq = VQCodebook(1, 4, 8, estimator="diveq", dead_after=5, penalty_rate=0.5)
    diveq.idle_steps.copy_(torch.tensor([[5.0, 4.0, 6.0, 0.0]]))
    assert diveq.dead_codes() == 2 and torch.equal(diveq.code_bias(), torch.tensor([[2.5, 2.0, 3.0, 0.0]]))


def test_a_step_revives_the_codes_below_the_layer_s_dead_threshold():
    """Every key goes to code 0; the other codes' counts decay from 1 to 0.99, below a threshold of 0.999:
    each is revived as one of the step's unit keys (at the default threshold, 0.01, none would be)."""
    torch.manual_seed(0)
    codebook = VQCodebook(1, 4, 8, dead_threshold=0.999)
    init = codebook.codebook.clone()
    k = torch.randn(1, 1, 6, 8)
    codebook.update_(k, torch.zeros(1, 1, 6, dtype=torch.long))
    unit = torch.nn.functional.normalize(k[0, 0], dim=-1)
    for code in (1, 2, 3):
        row = codebook.codebook[0, code]
        assert not torch.equal(row, init[0, code]) and torch.isclose(unit @ row, torch.tensor(1.0)).any(), code


def test_the_layer_s_loss_is_its_commitment_weighted():
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, commitment_weight=0.5, backend="blocked")
    _, aux = layer(torch.randn(2, 64, 32), return_aux=True)
    assert aux["commitment"] > 0 and torch.equal(aux["loss"], 0.5 * aux["commitment"])


@pytest.mark.parametrize("world, sync_ranks, summed", [(1, True, False), (2, True, True), (2, False, False)],
                         ids=["one-rank", "ranks", "sync-off"])
def test_the_codebook_update_sums_over_ranks_only_data_parallel_and_when_asked(monkeypatch, world, sync_ranks,
                                                                               summed):
    """A group of several ranks with ``sync_ranks``: the update reads statistics summed over them (the gloo run of
    two ranks is the data-parallel test below; here the group and the all-reduce are stood in for)."""
    import ovqflex.layers.vq as vq_layer

    calls = []
    monkeypatch.setattr(vq_layer.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(vq_layer.dist, "get_world_size", lambda: world)
    monkeypatch.setattr(vq_layer, "sum_over_ranks", lambda x: calls.append(x.shape) or x)
    for estimator in ("ste", "diveq"):
        codebook = VQCodebook(1, 4, 8, estimator=estimator)
        codebook.sync_ranks = sync_ranks
        codebook.update_(torch.randn(1, 1, 6, 8), torch.zeros(1, 1, 6, dtype=torch.long))
    assert vq_layer.data_parallel() == (world > 1) and bool(calls) == summed


@pytest.mark.parametrize("name", ["VQAttention", "LongVQBlock"])
def test_the_estimator_is_fixed_when_the_layer_is_built(name):
    """A "diveq" codebook is a parameter, an "ste" one a buffer: the estimator cannot change afterwards, nor be
    a test-time override; the other options can (``chunk_size``)."""
    layer = getattr(ovqflex, name)(32, 2, chunk_size=16)
    with pytest.raises(AttributeError, match=f"estimator of a {name} is fixed when it is built"):
        layer.estimator = "diveq"
    assert layer.estimator == "ste" and "estimator" not in layer.overrides and "chunk_size" in layer.overrides
    layer.chunk_size = 32
    assert layer.options.chunk_size == 32


def test_layer_diveq_trains_codebook_by_gradient():
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, estimator="diveq", backend="blocked")
    assert isinstance(layer.quantizer.codebook, torch.nn.Parameter)
    y = layer(torch.randn(2, 64, 32))
    y.square().mean().backward()
    assert layer.quantizer.codebook.grad is not None and layer.quantizer.codebook.grad.abs().sum() > 0
    assert layer.quantizer.idle_steps.max() <= 1  # one step: idle codes count 1, used ones 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("estimator", ["ste", "diveq"])
def test_a_cast_layer_keeps_its_codebooks_training_state_in_fp32(estimator, dtype):
    """``layer.to(bf16 | fp16)`` casts the codebook, not its training state: 300 updates from the same
    keys and codes give the fp32 layer's EMA counts and sums (or idle-step counts, past bf16's 256) bit
    for bit, and the EMA codebook is the fp32 one rounded once. In bf16 the state had drifted (the codebook
    5% after 400 updates) and DiVeQ's update failed on its dtypes."""
    H, N, D = 2, 16, 8
    wide = ovqflex.VQAttention(32, H, head_dim=D, codebook_size=N, chunk_size=16, estimator=estimator)
    cast = ovqflex.VQAttention(32, H, head_dim=D, codebook_size=N, chunk_size=16, estimator=estimator)
    cast.load_state_dict(wide.state_dict())
    cast = cast.to(dtype)
    assert cast.quantizer.codebook.dtype == dtype
    g = torch.Generator().manual_seed(1)
    for step in range(300):
        k = torch.randn(2, H, 64, D, generator=g).to(dtype)
        codes = torch.randint(0, N // 2, (2, H, 64), generator=g)  # half the codes never used
        for layer in (wide, cast):
            torch.manual_seed(step)  # (the same revival draws for both)
            layer.quantizer.update_(k, codes)
    state = [name for name in ovqflex.layers.vq.VQCodebook.accumulators if hasattr(wide.quantizer, name)]
    assert state
    for name in state:
        a, b = getattr(wide.quantizer, name), getattr(cast.quantizer, name)
        assert b.dtype == torch.float32 and torch.equal(a, b), name
    if estimator == "diveq":
        assert cast.quantizer.idle_steps.max() == 300
    else:
        assert torch.equal(cast.quantizer.codebook, wide.quantizer.codebook.to(dtype))
    assert cast.double().quantizer.codebook.dtype == torch.float64
    assert all(getattr(cast.quantizer, name).dtype == torch.float64 for name in state)  # wider stays wider


def test_a_bf16_diveq_layer_trains():
    """A DiVeQ layer cast to bf16 runs a training forward and backward (its idle-step update once mixed
    dtypes and failed)."""
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, estimator="diveq", backend="blocked")
    layer = layer.to(torch.bfloat16)
    layer(torch.randn(2, 64, 32, dtype=torch.bfloat16)).float().square().mean().backward()
    grad = layer.quantizer.codebook.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert layer.quantizer.idle_steps.dtype == torch.float32 and layer.quantizer.idle_steps.max() <= 1


CHECKPOINTED = {
    "vq-ste": lambda: ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, backend="blocked"),
    "vq-diveq": lambda: ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, estimator="diveq",
                                            backend="blocked"),
    "longvq": lambda: ovqflex.LongVQBlock(32, 2, chunk_size=16, codebook_size=8, backend="blocked"),
}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_activation_checkpointing_a_training_vq_layer_is_refused_and_an_eval_one_works(name, reentrant):
    """``torch.utils.checkpoint`` re-runs a training forward in the backward, where the codebook state was
    already updated: refused by name there (it had updated the state twice and given gradients 10% off the
    plain backward's). In eval mode the codebook is frozen and the re-run is the forward: gradients equal."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    plain, checked = CHECKPOINTED[name](), CHECKPOINTED[name]()
    checked.load_state_dict(plain.state_dict())
    x = torch.randn(2, 64, 32, requires_grad=True)  # (a reentrant checkpoint's output needs an input with grad)
    y = checkpoint(checked, x, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        y.square().mean().backward()
    checked.load_state_dict(plain.state_dict())  # (the refused run's first forward updated the codebook state)
    plain.eval(), checked.eval()
    checked.zero_grad()
    plain(x).square().mean().backward()
    checkpoint(checked, x, use_reentrant=reentrant).square().mean().backward()
    for (n, a), b in zip(plain.named_parameters(), checked.parameters()):
        assert_close(b.grad, a.grad, 1e-5, n)  # (the re-run's gradients add up in another order)


def test_a_compiled_checkpointed_training_vq_layer_is_refused():
    """Compiled, the checkpointed region's ops are recomputed in the backward graph, where the codebook
    buffer was already updated: the snapshot op refuses there too (it had given gradients 10% off)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = CHECKPOINTED["vq-ste"]()
    step = torch.compile(lambda x: checkpoint(layer, x, use_reentrant=False), fullgraph=True)
    y = step(torch.randn(2, 64, 32))
    with pytest.raises(RuntimeError, match="activation checkpointing"):
        y.square().mean().backward()


@pytest.mark.parametrize("estimator", ["ste", "diveq"])
def test_layer_compiles_fullgraph_without_recompile(estimator):
    """The EMA/no-use-penalty buffer updates run inside the compiled graph."""
    torch.manual_seed(0)
    layer = ovqflex.VQAttention(32, 2, chunk_size=32, codebook_size=16, estimator=estimator, local_bias=True,
                                backend="blocked")
    before = []

    def loss(compiled, step):
        before.append(layer.quantizer.codebook.detach().clone())
        y, aux = compiled(torch.randn(2, 128, 32), return_aux=True)
        return y.square().mean() + aux["loss"]

    def codebook_moved(step):
        assert not torch.equal(layer.quantizer.codebook.detach(), before[step])

    assert_trains_compiled_once(layer, loss, after_step=codebook_moved)


def test_hybrid_model_adds_vq_aux_loss():
    from ovqflex.models import HybridConfig, HybridLM

    torch.manual_seed(0)
    cfg = HybridConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, pattern="swa,vq", window=16, chunk_size=16,
                       block_size=16, backend="blocked", mixer_options={"vq": {"codebook_size": 8,
                                                                               "commitment_weight": 0.5}})
    model = HybridLM(cfg)
    tokens = torch.randint(0, 64, (2, 40))
    logits, aux = model(tokens, return_aux=True)
    assert logits.shape == (2, 40, 64) and aux.dim() == 0 and aux > 0
    k_weight = model.blocks[1].mixer.qkv_proj.weight
    g = torch.autograd.grad(aux, k_weight)[0]
    assert g[32:64].abs().sum() > 0 and g[:32].abs().sum() == 0  # commitment reaches k only
    assert torch.equal(model.eval()(tokens), model(tokens, return_aux=True)[0])


_EMA_UNDER_AUTOCAST = """
import copy, json, torch
from tools.cuda_rules import follow_cuda_rules
follow_cuda_rules()
import ovqflex
torch.manual_seed(0)
layers = {"vq": ovqflex.VQAttention(32, 2, chunk_size=16, codebook_size=8, backend="blocked"),
          "longvq": ovqflex.LongVQBlock(32, 2, chunk_size=16, codebook_size=8, backend="blocked")}
x = torch.randn(2, 64, 32).bfloat16()
same = {}
for name, layer in layers.items():
    runs = []
    for autocast in (False, True):
        torch.manual_seed(1)  # the revival draws of dead codes
        trained = copy.deepcopy(layer).bfloat16().train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            trained(x)
        runs.append(dict(trained.quantizer.named_buffers()))
    moved = not torch.equal(runs[0]["codebook"], layer.quantizer.codebook.bfloat16())
    same[name] = {"moved": moved, **{b: torch.equal(runs[0][b], runs[1][b]) for b in runs[0]}}
print(json.dumps(same))
"""


def test_ema_codebook_update_is_the_same_with_cudas_autocast_or_without():
    """A bf16 layer's training forward moves its EMA codebook the same way with bf16 autocast on or off, with
    CUDA's autocast rule followed on the CPU (``tools/cuda_rules.py``, in a process of its own): the update
    averages the fp32 unit keys the codes were assigned on. It normalized the keys with autocast on, which
    CUDA runs in fp32 (the CPU in bf16), so the codebook's bits depended on autocast there."""
    done = subprocess.run([sys.executable, "-c", _EMA_UNDER_AUTOCAST], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    same = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(same) == {"vq", "longvq"}
    for name, buffers in same.items():
        assert buffers.pop("moved"), f"{name}: the training forward left the codebook as it was"
        assert set(buffers) == {"codebook", "ema_counts", "ema_sums"}
        assert all(buffers.values()), f"{name}: buffers that differ with and without autocast: {buffers}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_data_parallel_ranks_keep_the_codebook_one_process_learns_from_the_whole_batch(tmp_path, compiled):
    """Two gloo ranks train VQ layers on halves of each batch (``vq_data_parallel.py``): after 3 steps both
    ranks hold the same codebook state bit for bit, the one a single process reaches on the whole batch (up
    to the order of the fp32 sums): EMA counts and sums, DiVeQ's idle-step counts. With every code revived at
    every step the ranks still agree (the mean of the keys they drew; one process draws from the whole batch,
    so it differs there). Each rank had updated its own copy from its own half: the ranks' codebooks had
    drifted apart (0.07 from the single process's after 3 steps) and a torchrun training of a ``swa,vq`` model
    lost the single process's loss from its second step."""
    done = subprocess.run([sys.executable, "-m", "tests.ovqflex.layers.vq_data_parallel", str(_free_port()),
                           str(tmp_path), *(["--compile"] if compiled else [])],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report) == {"ste", "diveq", "ste-revive"}
    for case, tensors in report.items():
        state = {"codebook", "idle_steps"} if case == "diveq" else {"codebook", "ema_counts", "ema_sums"}
        assert set(tensors) == state
        for name, r in tensors.items():
            assert r["ranks_equal"], f"{case}: the ranks' {name} differ"
            if case != "ste-revive":
                assert r["from_one"] <= 1e-6, f"{case}: {name} is {r['from_one']:.2e} from the single process's"
