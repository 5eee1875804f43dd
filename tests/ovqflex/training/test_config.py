"""TrainConfig: values checked on construction, dicts (checkpoints) checked key by key."""
import pytest

from ovqflex.training import TrainConfig


def test_round_trip():
    cfg = TrainConfig(steps=7, model_options={"d_model": 32}, pattern="swa,kvm")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


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
