"""A memory method plugged in through the public API (docs/adding-a-method.md): its op and layer (the
module, here inside this test file) plus one ``register_method`` call make it a ``HybridLM`` mixer, a
target of ``ovqflex viz`` and ``ovqflex profile``, a case of the ``viz`` and ``decode`` bench
scenarios, and subject to the conformance suite. No library file names it."""
import dataclasses
import functools
import math

import pytest
import torch
from torch import Tensor

from masks.program import AttentionProgram, build_program
from masks.regions import OwnChunk, StateBank
from ovqflex import METHODS, Method, attend, register_method
from ovqflex.layers.heads import MultiHeadProjection
from recurrences.checks import ConfigTypeError
from tests.ovqflex.conformance import CHECKS

# --- the method's module: "chunk means", a toy compressed memory ------------------------------------


def chunk_mean_program(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int, block_size: int) -> AttentionProgram:
    """q, k, v ``[B, H, T, D]`` -> the program in which query chunk ``c`` reads one state row per
    earlier chunk — that chunk's mean key and mean value, with bias ``log(chunk_size)`` (the row
    stands for its ``chunk_size`` tokens) — and its own chunk causally."""
    B, H, T, D = q.shape
    n_chunks, full = max(1, -(-T // chunk_size)), T // chunk_size
    if full == 0:
        return build_program(q, k, v, (OwnChunk(chunk_size),), scale=D**-0.5, block_size=block_size)

    def means(x):  # [B, H, T, D] -> every chunk's bank: the means of the complete chunks [B, H, n * full, D]
        m = x[:, :, :full * chunk_size].unflatten(2, (full, chunk_size)).mean(3)
        return m.unsqueeze(2).expand(B, H, n_chunks, full, x.shape[-1]).flatten(2, 3)

    live = torch.arange(n_chunks, device=q.device)  # chunk c reads the means of chunks 0..c-1
    bias = torch.full((B, H, n_chunks * full), math.log(chunk_size), device=q.device)
    return build_program(q, k, v, (StateBank(full, chunk_size, live), OwnChunk(chunk_size)), scale=D**-0.5,
                         state_k=means(k), state_v=means(v), state_bias=bias, block_size=block_size)


class ChunkMeanAttention(MultiHeadProjection):
    """x ``[B, T, hidden]`` -> ``[B, T, hidden]`` through :func:`chunk_mean_program`."""

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, chunk_size: int = 64,
                 qk_conv: int = 0, backend: str = "auto", block_size: int = 64):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        self.chunk_size, self.block_size = chunk_size, block_size

    def program(self, x: Tensor) -> AttentionProgram:
        q, k, v = self.split_heads(x)
        return chunk_mean_program(q, k, v, chunk_size=self.chunk_size, block_size=self.block_size)

    def _full(self, inputs) -> tuple[Tensor, dict]:
        """The full forward (``forward`` is the layer contract's: projections, this, ``o_proj``)."""
        q, k, v, _ = inputs
        program = chunk_mean_program(q, k, v, chunk_size=self.chunk_size, block_size=self.block_size)
        return attend(program, self.backend), {}


TOY = Method("chunkmean", ChunkMeanAttention, "toy memory: one mean row per earlier chunk + own chunk causal",
             from_config=lambda c: dict(head_dim=c.head_dim, chunk_size=c.chunk_size, qk_conv=c.qk_conv,
                                        backend=c.backend, block_size=c.block_size),
             defaults=dict(chunk_size=32, block_size=32),
             test_options=dict(chunk_size=16, block_size=16, backend="blocked"))

# --- what the registration gives --------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_method(TOY)
    yield
    METHODS.pop(TOY.name)


@pytest.mark.parametrize("check", list(CHECKS))
def test_passes_the_conformance_suite(check):
    CHECKS[check](TOY)


def test_is_a_hybrid_lm_mixer():
    from ovqflex.models import HybridConfig, HybridLM, available_mixers

    assert "chunkmean" in available_mixers()
    cfg = HybridConfig(vocab_size=40, d_model=32, n_heads=2, pattern="swa,chunkmean", window=8, chunk_size=16,
                       block_size=16, backend="blocked", mixer_options={"chunkmean": {"qk_conv": 2}})
    model = HybridLM(cfg)
    assert isinstance(model.blocks[1].mixer, ChunkMeanAttention) and model.blocks[1].mixer.qk_conv is not None
    tokens = torch.randint(0, 40, (2, 50))
    logits = model(tokens)
    logits.square().mean().backward()
    assert logits.shape == (2, 50, 40) and model.blocks[1].mixer.qkv_proj.weight.grad.abs().sum() > 0
    with pytest.raises(NotImplementedError, match="mixer 'chunkmean'"):  # it has no decode cache
        model.generate(tokens[:, :5], 2)


def test_is_drawn_and_profiled(tmp_path, capsys):
    from ovqflex.bench.profiler import ProfileConfig, profile_target
    from ovqflex.cli import main
    from ovqflex.viz import VizShape, drawable_methods, method_program

    assert "chunkmean" in drawable_methods()
    program, _, temps = method_program("chunkmean", VizShape(seq_len=100, heads=2, head_dim=8))
    assert [r.name for r in program.regions] == ["state", "window"] and temps == {}
    assert program.geom.n_state == 32  # 4 banks (chunks of 32) of 3 means (the complete chunks), one 32-row block
    assert main(["viz", "chunkmean", "--seq-len", "64", "--format", "term", "--view", "token",
                 "--out", str(tmp_path)]) == 0
    assert "#=state" in capsys.readouterr().out
    rows = profile_target(ProfileConfig(target="chunkmean", seq_len=64, heads=2, head_dim=8, steps=1, warmup=0,
                                        options=dict(backend="blocked")), tmp_path / "trace.json").stages
    assert {r["stage"] for r in rows} >= {"step", "backward"}


def test_runs_in_bench_scenarios():
    from ovqflex.bench.scenarios import KINDS, parse_scenario

    sc = parse_scenario({"kind": "viz", "method": "chunkmean", "seq_lens": [64, 128]}, "toy viz")
    rows = KINDS["viz"][1](sc, "cpu")
    assert [r["T"] for r in rows] == [64, 64, 128, 128] and all(r["time_s"] > 0 for r in rows)
    with pytest.raises(ValueError, match="kind must be one of .*'ovq'"):  # the decode bench wants a cache
        parse_scenario({"kind": "decode", "seq_lens": [64], "cases": [{"name": "t", "kind": "chunkmean"}]}, "toy")
    with pytest.raises(ValueError, match=r"mixer 'chunkmean' \(ChunkMeanAttention\) has no decode cache"):
        parse_scenario({"kind": "generate", "pattern": "swa,chunkmean"}, "toy")


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="method 'chunkmean' is already registered"):
        register_method(TOY)


@pytest.mark.parametrize("name, options, near", [("swa", {"windw": 3}, "window"),
                                                  ("ovq", {"max_centroid": 8}, "max_centroids"),
                                                  ("vla", {"refresh_evry": 4}, "refresh_every")])
def test_an_unknown_layer_option_is_a_config_type_error_naming_the_nearest(name, options, near):
    """Every method's layer, with or without an options dataclass, refuses an option it does not take
    by name: a ConfigTypeError (a TypeError, and a ConfigError the CLI reports as exit 2)."""
    with pytest.raises(ConfigTypeError, match=f"method '{name}' options: unknown key .* \\(did you mean '{near}'\\?\\)"):
        METHODS[name].build(32, 2, **options)


def test_fixed_options_must_be_arguments_of_the_layer():
    with pytest.raises(ValueError, match=r"method 'swa-typo': fixed options \['ropee'\] are not arguments of "
                                         "SlidingWindowAttention"):
        register_method(dataclasses.replace(METHODS["swa"], name="swa-typo", fixed=dict(ropee=True)))
    assert "swa-typo" not in METHODS


def test_the_head_dim_of_an_example_is_its_argument_not_an_option():
    with pytest.raises(ValueError, match="bad option for method 'ovq': head_dim is set by the head dim argument"):
        METHODS["ovq"].example(2, 16, {"head_dim": 8})


def test_vla_options_are_its_method_options():
    assert {"refresh_every", "lambda0"} <= METHODS["vla"].option_names()
    assert METHODS["vla"].build(32, 2, refresh_every=4).options.refresh_every == 4


def test_a_bug_in_a_layer_is_not_called_a_bad_option(monkeypatch):
    """example() turns bad options into a ValueError, but a plain TypeError (a bug) propagates."""
    swa = METHODS["swa"]

    class Broken(swa.layer):
        @functools.wraps(swa.layer.__init__)  # (the same options)
        def __init__(self, *args, **kwargs):
            raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")

    monkeypatch.setitem(METHODS, "swa", dataclasses.replace(swa, layer=Broken))
    with pytest.raises(TypeError, match="unsupported operand") as info:
        METHODS["swa"].example(2, 8)
    assert type(info.value) is TypeError
