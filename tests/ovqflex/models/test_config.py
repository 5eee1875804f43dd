"""HybridConfig and presets: checked by name, saved configs keep loading, method options in
``mixer_options`` (validated against the method, merged option by option, dotted override keys)."""
import math
import warnings

import pytest
import torch

import ovqflex
from ovqflex.models import PRESETS, HybridConfig, HybridLM, preset
from ovqflex.models.config import canonical_config, merge_config


def test_bad_config_values():
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_heads=4"):
        HybridConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="chunk_size must be a positive multiple of 16"):
        HybridConfig(chunk_size=24)
    for name in ("huge", ""):
        with pytest.raises(ValueError, match="preset must be one of"):
            preset(name)
    with pytest.raises(ValueError, match="model config: unknown key 'colour'; known keys: backend, "):
        HybridConfig.from_dict({"colour": "red"})


BAD_FIELDS = [
    ("pattern", ["swa", "ovq"], TypeError, r"pattern must be a comma-separated str of mixer names \(e.g. 'swa,ovq'\), "
                                           r"got list \['swa', 'ovq'\]"),
    # an empty name had been skipped: "swa,,ovq" built a swa,ovq model where a mixer was left out
    ("pattern", "swa,,ovq", ValueError, r"pattern must be mixer names separated by single commas \(e.g. 'swa,ovq'\), "
                                        r"got 'swa,,ovq'"),
    ("pattern", "", ValueError, "pattern must be mixer names separated by single commas"),
    # an unknown mixer had been found only when HybridLM built its layers
    ("pattern", "swa,wat", ValueError, r"pattern names unknown mixer 'wat'; available: \[.*'ovq'"),
    *[(name, 0, ValueError, f"{name} must be >= 1, got 0")
      for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "window", "n_bswa_chunks")],
    ("qk_conv", -1, ValueError, "qk_conv must be >= 0, got -1"),
    ("mlp_ratio", "4", TypeError, "mlp_ratio must be a number, got str '4'"),
    ("norm_eps", -1e-5, ValueError, "norm_eps must be a finite number > 0, got -1e-05"),
    ("rope_base", 0, ValueError, "rope_base must be a finite number > 0, got 0"),
    ("init_std", -0.02, ValueError, "init_std must be a finite number >= 0, got -0.02"),
    # infinities had been taken: init_std=inf made every weight inf, mlp_ratio=inf an OverflowError in
    # HybridLM, rope_base=inf turned RoPE off, norm_eps=inf zeroed every norm's output
    ("init_std", math.inf, ValueError, "init_std must be a finite number >= 0, got inf"),
    ("mlp_ratio", math.inf, ValueError, "mlp_ratio must be a finite number > 0, got inf"),
    ("rope_base", math.inf, ValueError, "rope_base must be a finite number > 0, got inf"),
    ("norm_eps", math.nan, ValueError, "norm_eps must be a finite number > 0, got nan"),
    ("qk_norm", "no", TypeError, "qk_norm must be True or False, got str 'no'"),
    ("qk_norm", 1, TypeError, "qk_norm must be True or False, got int 1"),
    ("backend", "cuda", ValueError, r"backend must be one of \['auto', 'blocked', 'dense', 'flex'\], got 'cuda'"),
]


@pytest.mark.parametrize("field, value, error, match", BAD_FIELDS, ids=[f"{case[0]}={case[1]}" for case in BAD_FIELDS])
def test_every_field_is_checked_at_construction(field, value, error, match):
    """A config built in Python (not from a dict) is checked once, by name: these had been accepted, to fail
    later far from the cause (``'list' object has no attribute 'split'``, a NaN norm) or never."""
    with pytest.raises(error, match=match):
        HybridConfig(**{field: value})


@pytest.mark.parametrize("block", [48, 8, 100], ids=["48", "8", "100"])
def test_a_block_size_flex_cannot_tile_is_refused_by_name(block):
    """Flex tiles a block with powers of two that must divide it: 48 or 100 cannot be served."""
    match = f"block_size must be a power of two >= 16 \\(16, 32, 64, 128, ...\\), got {block}"
    with pytest.raises(ValueError, match=match):
        HybridConfig(block_size=block)
    for make in (lambda: ovqflex.SlidingWindowAttention(32, 2, window=8, block_size=block),
                 lambda: ovqflex.OVQAttention(32, 2, chunk_size=16, block_size=block),
                 lambda: ovqflex.KVMAttention(32, 2, chunk_size=16, block_size=block),
                 lambda: ovqflex.VQAttention(32, 2, chunk_size=16, block_size=block),
                 lambda: ovqflex.LongVQBlock(32, 2, chunk_size=16, block_size=block)):
        with pytest.raises(ValueError, match=match):
            make()
    q = torch.randn(1, 1, 20, 16)
    with pytest.raises(ValueError, match=match):
        ovqflex.sliding_window_attention(q, q, q, window=4, block_size=block)


@pytest.mark.parametrize("d, error, match", [
    ({"n_head": 4}, ValueError, "model config: unknown key 'n_head' \\(did you mean 'n_heads'\\?\\)"),
    ({"d_model": "128"}, TypeError, "model config: d_model must be int, got str '128'"),
    ({"head_dim": 1.5}, TypeError, "head_dim must be int \\| None, got float"),
], ids=["misspelt", "type", "optional"])
def test_config_dicts_are_checked_by_name(d, error, match):
    with pytest.raises(error, match=match):
        HybridConfig.from_dict(d)
    with pytest.raises(error, match=match.replace("model config", "model config \\(preset 'tiny'\\)")):
        preset("tiny", **d)


def test_presets_build_and_roundtrip():
    for name in PRESETS:
        cfg = preset(name)
        assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    paper = preset("paper-icr")
    assert (paper.n_layers, paper.d_model, paper.head_dim, paper.vocab_size) == (8, 768, 128, 10000)


def test_configs_saved_with_bswa_chunks_still_load():
    """``bswa_chunks`` was renamed ``n_bswa_chunks``; saved configs (checkpoints) keep loading for a release."""
    saved = {**HybridConfig().to_dict(), "bswa_chunks": 3}
    del saved["n_bswa_chunks"]
    with pytest.warns(DeprecationWarning, match="bswa_chunks is renamed n_bswa_chunks"):
        assert HybridConfig.from_dict(saved) == HybridConfig(n_bswa_chunks=3)
    with pytest.raises(ValueError, match="model config: 'bswa_chunks' is the old name of 'n_bswa_chunks', "
                                         "and both are given"):
        HybridConfig.from_dict({**saved, "n_bswa_chunks": 2})


def _ovq_caps(cfg: HybridConfig) -> list[int]:
    with torch.device("meta"):
        model = HybridLM(cfg)
    return [b.mixer.max_centroids for b in model.blocks if b.mixer_name == "ovq"]


def test_every_config_field_reaches_the_mixers_that_take_it():
    """A model of every mixer with each shared field away from the layers' own defaults (``qk_norm``: the
    config's default True, the layers' False): each mixer is built with the config's head dim, q/k
    convolution, backend, block size, RoPE base, q/k norm, window, chunk and block window (each where the
    method takes it, ``ovqflex/methods.py``), LongVQ with the config's norm epsilon; and the KVM layer's
    inspector temperatures are its own (``tau_state`` on the state, ``tau_bswa`` on the window)."""
    from masks.regions import BlockWindow, TokenWindow
    from ovqflex.methods import METHODS

    mixers = ["full", "nope", "swa", "bswa", "ovq", "kvm", "vq", "longvq", "linear", "deltanet", "vla"]
    cfg = HybridConfig(vocab_size=32, d_model=32, n_layers=len(mixers), n_heads=2, head_dim=8,
                       pattern=",".join(mixers), norm_eps=1e-3, qk_norm=True, qk_conv=3, rope_base=500.0, window=24,
                       chunk_size=32, n_bswa_chunks=3, backend="dense", block_size=16)
    layers = {b.mixer_name: b.mixer for b in HybridLM(cfg).blocks}
    assert sorted(layers) == sorted(mixers)
    for name, layer in layers.items():
        assert layer.head_dim == 8, name
        if name != "longvq":
            assert layer.qk_conv == 3, name
        if name not in ("linear", "deltanet", "vla"):
            assert (layer.backend, layer.block_size) == ("dense", 16), name
        if name in ("full", "swa", "bswa", "kvm"):
            assert layer.rope_base == 500.0, name
        if name in ("full", "nope", "swa", "bswa"):
            assert layer.qk_norm is True, name
        if name in ("ovq", "kvm", "vq", "longvq"):
            assert layer.chunk_size == 32, name
    assert any(isinstance(r, TokenWindow) and r.window == 24 for r in layers["swa"].regions)
    assert any(isinstance(r, BlockWindow) and (r.width, r.chunk_size) == (3, 32) for r in layers["bswa"].regions)
    assert layers["kvm"].n_bswa_chunks == 3
    assert layers["longvq"].norm1.eps == layers["longvq"].norm2.eps == 1e-3
    kvm = layers["kvm"]
    with torch.no_grad():
        kvm.tau_state.fill_(2.0)
        kvm.tau_bswa.fill_(3.0)
    temps = METHODS["kvm"].temperatures(kvm)
    assert temps["state"].tolist() == [2.0, 2.0] and temps["window"].tolist() == [3.0, 3.0]


def test_method_options_live_in_mixer_options_and_reach_the_layer():
    assert preset("tiny").mixer_options == {}  # the OVQ default cap, N = 2048
    assert _ovq_caps(preset("tiny", vocab_size=64)) == [2048]
    assert preset("small").mixer_options == {"ovq": {"max_centroids": 1024}}
    assert _ovq_caps(preset("small", vocab_size=64)) == [1024, 1024]


@pytest.mark.parametrize("overrides, expected", [
    ({"ovq.growth": "full"}, {"ovq": {"max_centroids": 1024, "growth": "full"}}),
    ({"mixer_options": {"ovq": {"seeding": "random"}, "kvm": {"sink_len": 2}}},
     {"ovq": {"max_centroids": 1024, "seeding": "random"}, "kvm": {"sink_len": 2}}),
    ({"ovq.max_centroids": 64}, {"ovq": {"max_centroids": 64}}),
], ids=["dotted", "nested", "replace"])
def test_overrides_merge_into_the_preset_option_by_option(overrides, expected):
    cfg = preset("small", **overrides)
    assert cfg.mixer_options == expected
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    assert PRESETS["small"]["mixer_options"] == {"ovq": {"max_centroids": 1024}}  # the preset is not modified


def test_merge_config_keeps_both_sides_and_refuses_an_option_given_twice():
    assert merge_config({"window": 8, "ovq.max_centroids": 8}, {"ovq.growth": "full", "window": 4}) == {
        "window": 4, "mixer_options": {"ovq": {"max_centroids": 8, "growth": "full"}}}
    with pytest.raises(ValueError, match=r"'ovq.max_centroids' sets mixer_options\['ovq'\]\['max_centroids'\], "
                                         "which is given twice"):
        canonical_config({"ovq.max_centroids": 8, "mixer_options": {"ovq": {"max_centroids": 16}}})


@pytest.mark.parametrize("options, error, match", [
    ({"ovqq": {}}, TypeError, r"mixer_options: unknown key 'ovqq' \(did you mean 'ovq'\?\)"),
    ({"sinks": {}}, TypeError, "mixer_options: unknown key 'sinks'"),  # a method, but not a HybridLM mixer
    ({"ovq": {"max_centroid": 8}}, TypeError,
     r"mixer_options\['ovq'\]: unknown key 'max_centroid' \(did you mean 'max_centroids'\?\)"),
    ({"ovq": {"options": None}}, TypeError, r"mixer_options\['ovq'\]: unknown key 'options'"),
    ({"ovq": {"max_centroids": 0}}, ValueError, r"mixer_options\['ovq'\]: max_centroids must be >= 1, got 0"),
    ({"kvm": {"budget": "cubic"}}, ValueError, r"mixer_options\['kvm'\]: budget must be one of"),
    ({"ovq": 8}, TypeError, r"mixer_options\['ovq'\] must be a dict of options, got int"),
    ([], TypeError, "mixer_options must be (a )?dict"),
], ids=["mixer", "not-a-mixer", "option", "options-object", "value", "kvm-value", "entry-type", "type"])
def test_bad_mixer_options_are_refused_when_the_config_is_made(options, error, match):
    """Made in Python, read from a dict (a saved config) or merged into a preset: refused by name alike."""
    with pytest.raises(error, match=match):
        HybridConfig(mixer_options=options)
    with pytest.raises(error, match=match):
        HybridConfig.from_dict({"mixer_options": options})
    with pytest.raises(error, match=match):
        preset("small", mixer_options=options)


def test_a_mixer_option_is_checked_with_what_the_config_sets():
    """chunk_size 16 comes from the config: an OVQ growth horizon is checked against the full options."""
    with pytest.raises(ValueError, match=r"mixer_options\['ovq'\]: growth_horizon"):
        HybridConfig(chunk_size=16, mixer_options={"ovq": {"growth": "linear", "growth_horizon": 0}})
    # KVM's sinks must fit in the initial state, the config's 16-token chunk (KVM's own default is 128)
    with pytest.raises(ValueError, match=r"mixer_options\['kvm'\]: sink_len must be < chunk_size=16"):
        HybridConfig(chunk_size=16, mixer_options={"kvm": {"sink_len": 16}})


def test_configs_saved_with_ovq_fields_still_load_as_the_same_model():
    """Earlier releases had ``max_centroids``, ``growth``, ``seeding`` as config fields: they move into
    ``mixer_options["ovq"]`` (defaults dropped, so an old tiny run still equals today's tiny preset)."""
    saved = {**preset("tiny").to_dict(), "max_centroids": 2048, "growth": "plateau", "seeding": "spread"}
    with pytest.warns(DeprecationWarning, match=r"max_centroids, growth, seeding are now OVQ options"):
        assert HybridConfig.from_dict(saved) == preset("tiny")
    saved = {**preset("small").to_dict(), "max_centroids": 1024, "growth": "full", "seeding": "spread",
             "mixer_options": {}}
    with pytest.warns(DeprecationWarning):
        assert HybridConfig.from_dict(saved) == preset("small", **{"ovq.growth": "full"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's keys: no warning
        HybridConfig.from_dict(preset("small").to_dict())
