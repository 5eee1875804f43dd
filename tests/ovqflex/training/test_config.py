"""TrainConfig: values checked on construction, dicts (checkpoints) checked key by key."""
import json

import pytest

from ovqflex.training import TrainConfig


def test_round_trip():
    cfg = TrainConfig(steps=7, model_options={"d_model": 32}, pattern="swa,kvm")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_a_length_warmup_round_trips_through_json():
    """A checkpoint's state.json holds the warm-up lengths as a list; they come back a tuple, so a
    resume compares equal settings as equal."""
    cfg = TrainConfig(seq_len=512, steps=10, length_warmup=(128, 256), length_warmup_steps=4)
    back = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.length_warmup == (128, 256)
    with pytest.raises(TypeError, match=r"length_warmup must be tuple\[int, ...\], got list \['128'\]"):
        TrainConfig.from_dict({**cfg.to_dict(), "length_warmup": ["128"]})


@pytest.mark.parametrize("change, match", [
    ({"length_warmup": (100,)}, r"increasing lengths shorter than seq_len=512 that divide it .*got \(100,\)"),
    ({"length_warmup": (256, 128)}, r"increasing lengths .*got \(256, 128\)"),
    ({"length_warmup": (128, 128)}, r"increasing lengths .*got \(128, 128\)"),
    ({"length_warmup": (512,)}, r"shorter than seq_len=512"),
    ({"length_warmup": (128, 256), "length_warmup_steps": 1}, r"length_warmup_steps must be in \[2, steps=10\)"),
    ({"length_warmup": (128,), "length_warmup_steps": 10}, r"must be in \[1, steps=10\) .* at least one at seq_len"),
    ({"length_warmup": (), "length_warmup_steps": 3}, r"length_warmup_steps=3 needs length_warmup"),
    ({"length_warmup": [128]}, r"length_warmup must be a tuple of ints"),
], ids=["not-dividing", "decreasing", "repeated", "not-shorter", "too-few-steps", "none-at-seq-len", "no-lengths",
        "list"])
def test_a_bad_length_warmup_is_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"seq_len": 512, "steps": 10, "length_warmup_steps": 4, **change})


@pytest.mark.parametrize("change, error, match", [
    ({"seq_len": 64, "ckpt_evry": 5}, ValueError,
     "train config: unknown key 'ckpt_evry' \\(did you mean 'ckpt_every'\\?\\)"),
    ({"colour": "red"}, ValueError, "train config: unknown key 'colour'; known keys: batch_size, "),
    ({"steps": "10"}, TypeError, "train config: steps must be int, got str '10'"),
    ({"lr": None}, TypeError, "train config: lr must be float, got NoneType"),
], ids=["misspelt", "unknown", "type", "none"])
def test_from_dict_refuses_what_it_would_have_dropped(change, error, match):
    """from_dict used to drop unknown keys silently: a misspelt key in a saved config is now named."""
    with pytest.raises(error, match=match):
        TrainConfig.from_dict({**TrainConfig().to_dict(), **change})


@pytest.mark.parametrize("field, value", [("lr", float("inf")), ("lr", float("nan")), ("min_lr", -1e-5),
                                          ("grad_clip", float("inf")), ("weight_decay", float("nan"))],
                         ids=["lr-inf", "lr-nan", "min_lr-negative", "grad_clip-inf", "weight_decay-nan"])
def test_optimizer_numbers_must_be_finite(field, value):
    """``--lr inf`` had been accepted (the run diverged at its first logged step), ``--lr nan`` refused by
    torch's optimizer only, in its own words."""
    with pytest.raises(ValueError, match=f"{field} must be a finite number >= 0, got {value!r}"):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("change, match", [
    (dict(lr=0.0), "lr must be > 0, got 0.0"),
    (dict(deterministic="yes"), r"deterministic must be True, False or None \(on for CPU, off for CUDA\), got 'yes'"),
    (dict(compile=1), "compile must be True or False, got 1"),
    (dict(progress="no"), "progress must be True or False, got 'no'"),
], ids=["lr-0", "deterministic-str", "compile-int", "progress-str"])
def test_a_zero_learning_rate_and_non_bool_switches_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**change)
