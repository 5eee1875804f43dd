"""HybridLM: mixer patterns, causality, overrides, compile without graph breaks."""
import pytest
import torch
import torch.nn.functional as F

from ovqflex.models import HybridConfig, HybridLM, available_mixers
from tests.helpers import FWD_TOL, OLD_TORCH, VECMASK_FAULT, assert_close, assert_parameter_gradients_match

SMALL = dict(vocab_size=64, d_model=32, n_heads=2, window=16, chunk_size=16, block_size=16, backend="blocked",
             mixer_options={"ovq": {"max_centroids": 16}})


def small(pattern: str, **kw) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig(pattern=pattern, n_layers=len(pattern.split(",")), **{**SMALL, **kw}))


def _model_reference(model, tokens, eps):
    """The model written out with its mixers as black boxes: ``h = E[tokens]``; per pre-norm block ``h += mixer(
    rms(h) g1)``, ``h += W_down(silu(W_gate rms(h) g2) * W_up rms(h) g2)``; a standalone block (LongVQ) is ``h =
    block(h)``; logits ``rms(h) g E^T`` (the head tied to the embedding), ``rms(x) = x / sqrt(mean(x^2) + eps)``."""
    rms = lambda x, g: x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * g  # noqa: E731
    h = model.embed.weight[tokens]
    for block in model.blocks:
        if block.standalone:
            h = block.mixer(h)
            continue
        h = h + block.mixer(rms(h, block.norm1.weight))
        x = rms(h, block.norm2.weight)
        w_gate, w_up = block.mlp.gate_up.weight.chunk(2, dim=0)
        h = h + F.silu(x @ w_gate.T) * (x @ w_up.T) @ block.mlp.down.weight.T
    return rms(h, model.norm.weight) @ model.embed.weight.T


@pytest.mark.parametrize("pattern", ["swa,ovq", "longvq,kvm"])
def test_model_is_its_blocks_written_out(pattern):
    """Logits and every parameter's gradient equal :func:`_model_reference`'s, with the norms' gains away from
    one (they start equal, so a block reading the wrong norm would pass at initialisation)."""
    model = small(pattern, norm_eps=1e-3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    tokens = torch.randint(0, 64, (2, 100))  # 7 chunks: KVM merges into its state (its gate has a gradient)
    logits, ref = model(tokens), _model_reference(model, tokens, eps=1e-3)
    assert_close(logits, ref, FWD_TOL[torch.float32], "logits")
    assert_parameter_gradients_match(model, logits, ref)


def test_pattern_repeats_over_layers():
    cfg = HybridConfig(pattern="swa,ovq", n_layers=5)
    assert cfg.mixers == ["swa", "ovq", "swa", "ovq", "swa"]
    model = HybridLM(HybridConfig(**{**SMALL, "pattern": " swa , nope ", "n_layers": 3}))
    assert [b.mixer_name for b in model.blocks] == ["swa", "nope", "swa"]


def test_available_mixers_cover_the_plain_ovq_and_kvm_layers():
    assert {"full", "nope", "swa", "bswa", "ovq", "kvm", "vq", "longvq"} <= set(available_mixers())


@pytest.mark.parametrize("pattern, match", [("swa,wat", "unknown mixer 'wat'.*available"),
                                            (",", "mixer names separated by single commas")],
                         ids=["unknown", "empty"])
def test_bad_pattern(pattern, match):
    """Refused by the config, before a model is built (an unknown mixer had been found by ``HybridLM``)."""
    with pytest.raises(ValueError, match=match):
        HybridConfig(**{**SMALL, "pattern": pattern})


def test_head_is_tied_to_embedding():
    model = small("swa,ovq")
    tokens = torch.randint(0, 64, (1, 20))
    h = model.embed(tokens)
    for block in model.blocks:
        h, _ = block(h)
    expected = model.norm(h) @ model.embed.weight.T
    assert torch.allclose(model(tokens), expected, atol=1e-5)
    assert not any("head" in name for name, _ in model.named_parameters())


def test_forward_refuses_bad_tokens_a_foreign_cache_and_aux_from_a_cached_forward():
    model = small("swa")
    with pytest.raises(TypeError, match="tokens must be int64"):
        model(torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"tokens must have 2 dims, got shape \(8,\)"):
        model(torch.zeros(8, dtype=torch.int64))
    vocab = model.config.vocab_size
    for bad, lo, hi in (([[3, vocab]], 3, vocab), ([[-2, 5]], -2, 5)):  # eager on a CPU: by name (was an IndexError)
        with pytest.raises(ValueError, match=rf"tokens ids must lie in \[0, {vocab}\) \(the model's vocab_size\), "
                                             rf"got ids from {lo} to {hi}"):
            model(torch.tensor(bad))
    tokens = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"cache must be a ModelCache \(from forward\(\.\.\., use_cache=True\)\), "
                                        r"got dict"):
        model(tokens, cache={})
    with pytest.raises(ValueError, match="return_aux is for training forwards; a cached"):
        model(tokens, use_cache=True, return_aux=True)


@pytest.mark.parametrize("pattern", ["full", "nope", "swa", "bswa", "ovq", "swa,ovq", "kvm", "swa,kvm"])
def test_causal(pattern):
    """Logits at position i do not change when tokens after i change."""
    model = small(pattern)
    a = torch.randint(0, 64, (2, 40))
    b = a.clone()
    b[:, 25:] = torch.randint(0, 64, (2, 15))
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.equal(la[:, :25], lb[:, :25])
    assert not torch.allclose(la[:, 25:], lb[:, 25:])


@pytest.mark.parametrize("mixer", ["full", "nope", "swa", "bswa", "ovq", "kvm", "vq", "longvq", "linear", "deltanet",
                                   "vla"])
def test_a_float64_model_runs_in_float64_with_the_auto_backend(mixer):
    """``model.double()`` (a gradient check, say): inference and training forwards with ``backend="auto"``
    (blocked: CPU flex takes no float64) give float64 logits equal to the dense backend's in float64.
    The no-grad forward used to fail in inductor's CPU flex lowering, and a KVM model failed either way."""
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))

    def models():  # fresh ones per forward: a training forward moves VQ's codebook
        return (small(f"{mixer},swa", backend=b).double() for b in ("auto", "dense"))

    auto, dense = models()
    with torch.no_grad():
        inference, want = auto(tokens), dense(tokens)
    assert inference.dtype == torch.float64
    assert_close(inference, want, FWD_TOL[torch.float64], "no grad")
    auto, dense = models()
    training, want = auto(tokens), dense(tokens)
    assert training.dtype == torch.float64
    assert_close(training, want, FWD_TOL[torch.float64], "with grad")
    training.sum().backward()
    grads = [p.grad for p in auto.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float64 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("patterns", [("full", "nope", "swa", "bswa", "ovq", "kvm"),
                                      ("vq", "longvq", "linear", "deltanet", "vla")], ids=["attention", "others"])
def test_an_empty_batch_gives_empty_logits(patterns):
    """Zero sequences (the last shard of a split batch, a filter that kept none) train, infer and generate
    as any batch, with the auto backend (flex for inference); the chunk size puts routed state in view.
    They had failed in every mixer: the head split's ``view(B, T, -1, ...)`` is ambiguous for zero
    elements, and flex's lowering indexed the empty captured tensors. The auxiliary loss of no tokens is 0
    (VQ's and LongVQ's commitment loss had been the mean of none: NaN)."""
    for mixer in patterns:
        model = small(f"{mixer},swa", backend="auto")
        tokens = torch.zeros(0, 40, dtype=torch.long)
        logits, aux_loss = model(tokens, return_aux=True)
        assert logits.shape == (0, 40, 64) and aux_loss.item() == 0, mixer
        (logits.sum() + aux_loss).backward()
        with torch.no_grad():
            assert model.eval()(tokens).shape == (0, 40, 64), mixer
        for decode in ("functional", "static"):
            assert model.generate(tokens[:, :5], 3, decode=decode).shape == (0, 8), (mixer, decode)


def test_batch_rows_are_independent():
    model = small("swa,ovq")
    x = torch.randint(0, 64, (3, 48))
    with torch.no_grad():
        full = model(x)
        alone = model(x[1:2])
    assert torch.allclose(full[1:2], alone, atol=1e-5)


def test_overrides_set_and_restore():
    model = small("swa,ovq,swa,ovq")
    prev = model.set_overrides(max_centroids=64)
    assert prev == {"max_centroids": 16}
    assert [b.mixer.max_centroids for b in model.blocks if b.mixer_name == "ovq"] == [64, 64]
    model.set_overrides(**prev)
    assert model.blocks[1].mixer.max_centroids == 16
    with pytest.raises(ValueError, match="override window_size=3: no mixer"):
        model.set_overrides(window_size=3)


@pytest.mark.parametrize("override, built", [
    (dict(window=4), dict(window=4)),
    (dict(n_sinks=2), dict(mixer_options={**SMALL["mixer_options"], "swa": {"n_sinks": 2}})),
    (dict(block_window=2), dict(mixer_options={**SMALL["mixer_options"], "swa": {"block_window": 2}})),
], ids=["window", "n_sinks", "block_window"])
def test_a_window_override_computes_as_the_model_built_with_it(override, built):
    """A window layer's window is its regions: an override rebuilds them (it had set an attribute
    nothing read, and the eval it named measured the trained window)."""
    x = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
    model, want = small("swa,ovq"), small("swa,ovq", **built)  # the same weights: no parameter reads the window
    with torch.no_grad():
        trained = model(x)
        model.set_overrides(**override)
        assert torch.equal(model(x), want(x))
    assert not torch.equal(model(x), trained)


@pytest.mark.parametrize("overrides, match", [
    (dict(training=False), r"override training=False: no mixer of pattern 'swa,ovq' takes 'training' at test "
                           r"time; they take \['backend', 'block_size', 'block_window', .*'window'\]"),
    (dict(rope_base=100.0), "no mixer of pattern 'swa,ovq' takes 'rope_base' at test time"),
    (dict(max_centroids=64, window=-1), "override window=-1: window must be >= 1, got -1"),
    (dict(max_centroids=64, backend="cuda"), r"override backend='cuda': backend must be one of \["),
    (dict(max_centroids=64, window="4"), "override window='4': window must be an int, got str '4'"),
], ids=["not-an-option", "built-in", "bad-window", "bad-backend", "window-type"])
def test_an_override_is_a_test_time_option_with_a_good_value_or_none_is_set(overrides, match):
    """Only what a layer reads at every call can be overridden, each value checked by the layer; on
    an error no override stays set (a bad backend had been found at the first forward)."""
    model = small("swa,ovq")
    with pytest.raises((ValueError, TypeError), match=match):
        model.set_overrides(**overrides)
    ovq, swa = model.blocks[1].mixer, model.blocks[0].mixer
    assert (ovq.max_centroids, swa.window, swa.backend, ovq.backend, swa.training) == (16, 16, "blocked", "blocked",
                                                                                      True)


def test_overridden_gives_each_mixer_its_own_value_back():
    """Mixers whose values differ (OVQ's chunk 32, KVM's the config's 16) get each its own back, where the
    dict set_overrides returns holds one value per key."""
    model = small("ovq,kvm", mixer_options={**SMALL["mixer_options"], "ovq": {"max_centroids": 16, "chunk_size": 32}})
    ovq, kvm = model.blocks[0].mixer, model.blocks[1].mixer
    with model.overridden(chunk_size=64, max_centroids=8) as same:
        assert same is model and (ovq.chunk_size, kvm.chunk_size, ovq.max_centroids) == (64, 64, 8)
    assert (ovq.chunk_size, kvm.chunk_size, ovq.max_centroids) == (32, 16, 16)
    with pytest.raises(ValueError, match="override chunk_size=100"), model.overridden(chunk_size=100):
        pass
    assert (ovq.chunk_size, kvm.chunk_size) == (32, 16)
    assert model.set_overrides(chunk_size=64) == {"chunk_size": 32}  # one value per key: the first mixer's


def test_kvm_state_cap_override_changes_long_context_outputs():
    model = small("kvm", mixer_options={"kvm": {"budget": "power_law", "growth_factor": 8.0}})
    x = torch.randint(0, 64, (1, 128))
    with torch.no_grad():
        capped = model(x)  # max_state_chunks=1: the state stays at one chunk
        assert model.set_overrides(max_state_chunks=None) == {"max_state_chunks": 1}
        grown = model(x)
    # C=16, Nb=2: chunk 2 reads the initial 16 rows either way; from chunk 3 on (ctx 48, budget
    # floor(8 sqrt 48) = 55) the uncapped state has grown to 32 rows. (Not bit-equal: the
    # program's state layout has more rows, so the blocked sums are ordered differently.)
    assert torch.allclose(capped[:, :48], grown[:, :48], atol=1e-5)
    assert not torch.allclose(capped[:, 48:], grown[:, 48:])


def test_larger_dictionary_at_test_time_changes_long_context_outputs():
    model = small("ovq")
    x = torch.randint(0, 64, (1, 96))
    with torch.no_grad():
        base = model(x)
        model.set_overrides(max_centroids=96)
        more = model(x)
    assert torch.equal(base[:, :16], more[:, :16])  # the first chunk reads no dictionary
    assert not torch.allclose(base[:, 32:], more[:, 32:])


def test_logn_len_override_reaches_the_full_attention_layers_only():
    model = small("nope,swa")
    x = torch.randint(0, 64, (1, 80))
    with torch.no_grad():
        base = model(x)
        assert model.set_overrides(logn_len=32) == {"logn_len": 0}
        scaled = model(x)
    assert [getattr(b.mixer, "logn_len", None) for b in model.blocks] == [32, None]
    assert torch.equal(base[:, :32], scaled[:, :32])  # up to 32 keys the logits are unchanged
    assert not torch.allclose(base[:, 40:], scaled[:, 40:])
    with pytest.raises(ValueError, match="logn_len must be 0 \\(off\\) or an int >= 2"):
        model.set_overrides(logn_len=1)


def test_compiled_train_step_has_no_graph_break_and_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = small("swa,ovq")
    x = torch.randint(0, 64, (2, 64))
    y = torch.randint(0, 64, (2, 64))
    compiled = torch.compile(model, fullgraph=True)
    loss_c = F.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
    loss_c.backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_e = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss_e.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.allclose(loss_c, loss_e, rtol=1e-5)
    for gc, p in zip(grads_c, model.parameters()):
        assert torch.allclose(gc, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(OLD_TORCH, reason=f"torch < 2.13 on the CPU: {VECMASK_FAULT}")
def test_compiled_longvq_training_on_two_threads_equals_eager():
    """A LongVQ model's compiled backward on two CPU threads fuses the token embedding's scatter-add
    with the EMA's ``[D, B*T]`` gradient in a transposing kernel: with torch 2.13's inductor it wrote
    past the embedding gradient (heap corruption) until ``recurrences.compiling.patch_inductor_cpu_atomic_add``
    (applied at the first compile of a process that made a layer). The gradients equal the eager ones.
    Slow (~65 s cold): the default run checks the mend on a small embedding backward
    (tests/recurrences/test_compiling.py) and the LongVQ layer's compiled training (test_longvq.py)."""
    import copy

    from ovqflex.models import preset

    torch.manual_seed(0)
    eager = HybridLM(preset("tiny", pattern="longvq", vocab_size=64, backend="blocked", n_layers=1))
    model = copy.deepcopy(eager)
    x = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m in (eager, torch.compile(model)):
            F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    finally:
        torch.set_num_threads(threads)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        if p.grad is not None:
            assert_close(q.grad, p.grad, 1e-4, name)


def test_initialisation_scales_the_pre_norm_residual_branches():
    """Normal(0, init_std) embedding and linears, biases zero, norms one; the two linears of each pre-norm block
    that write into the residual stream (the mixer's ``o_proj``, the MLP's ``down``) at ``init_std /
    sqrt(2 n_layers)``, so the stream's variance does not grow with depth. LongVQ's block is post-norm (it
    normalises after each of its sums), so its linears keep ``init_std``. Weight stds within 30% (the
    smallest linear, [2, 64], has 128 weights: a sample std off by 30% is ~5 of its standard errors)."""
    pattern = "swa,ovq,kvm,vq,linear,deltanet,vla,longvq"
    cfg = HybridConfig(vocab_size=64, d_model=64, n_layers=8, n_heads=2, pattern=pattern, chunk_size=16,
                       init_std=0.05)
    torch.manual_seed(0)
    model = HybridLM(cfg)
    out_std = 0.05 / 4  # sqrt(2 * 8)
    stds = {"embed.weight": (model.embed.weight, 0.05)}
    for i, block in enumerate(model.blocks):
        residual = set() if block.standalone else {block.mixer.o_proj, block.mlp.down}
        assert block.standalone == (cfg.mixers[i] == "longvq")
        for name, mod in block.named_modules():
            if isinstance(mod, torch.nn.Linear):
                stds[f"blocks.{i}.{name}"] = (mod.weight, out_std if mod in residual else 0.05)
                assert mod.bias is None or not mod.bias.any(), f"blocks.{i}.{name}: bias not zero"
            if isinstance(mod, (torch.nn.RMSNorm, torch.nn.LayerNorm)) and mod.weight is not None:
                assert torch.equal(mod.weight, torch.ones_like(mod.weight)), f"blocks.{i}.{name}: norm not one"
    assert len([name for name, (_, s) in stds.items() if s == out_std]) == 2 * 7
    for name, (weight, want) in stds.items():
        assert weight.std().item() == pytest.approx(want, rel=0.3), name
        assert abs(weight.mean().item()) < 0.3 * want, name


def test_swiglu_width_and_the_parameter_count():
    """The MLP's hidden width is ``mlp_ratio * d * 2/3`` rounded *up* to a multiple of 16 (d = 32: 85.3 -> 96;
    d = 48 and 24: 128 and 64 exactly); ``num_parameters`` counts every parameter, vectors (norms, beta) too."""
    from ovqflex.models.hybrid import SwiGLU

    for d, hidden in ((32, 96), (48, 128), (24, 64)):
        mlp = SwiGLU(d, 4.0)
        assert (mlp.gate_up.weight.shape, mlp.down.weight.shape) == ((2 * hidden, d), (d, hidden)), d
    V, d, H, L = 64, 32, 2, 3  # per block: beta [H], qkv [3d, d], o [d, d], two norms [d], gate_up [192, d], down
    model = HybridLM(HybridConfig(vocab_size=V, d_model=d, n_heads=H, n_layers=L, pattern="full"))
    assert model.num_parameters() == V * d + L * (H + 4 * d * d + 2 * d + 3 * d * 96) + d


def test_the_aux_loss_is_the_sum_of_the_mixers_aux_losses():
    """Two VQ layers' commitment losses (and none from the window layer between them) add up."""
    model = small("vq,swa,vq")
    losses = []
    for block in model.blocks:
        block.mixer.register_forward_hook(lambda module, args, out: losses.append(out[1].get("loss")))
    _, aux = model(torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1)), return_aux=True)
    assert losses[1] is None and losses[0] > 0 and losses[2] > 0 and losses[0] != losses[2]
    assert aux.dtype == torch.float32 and torch.equal(aux, losses[0].float() + losses[2].float())


def test_logits_are_fp32_under_autocast():
    model = small("swa,ovq")
    x = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert model(x).dtype == torch.float32
        logits, cache = model(x[:, :19], use_cache=True)
        assert logits.dtype == torch.float32 and model(x[:, 19:], cache=cache)[0].dtype == torch.float32
