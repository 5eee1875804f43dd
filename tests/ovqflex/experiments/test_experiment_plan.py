"""Planning: the units, run directories and configs of an experiment, and the checks that
fail before any training (lengths the task cannot generate, bad mixer options, overrides)."""
import json

import pytest

from ovqflex.experiments import (TRAIN_LENGTH, EvalSetting, EvalSweep, Experiment, ModelSpec, Scale, get_experiment,
                                 plan)
from ovqflex.training.setup import TASK_SCALES


def test_icr_cpu_plan(tmp_path):
    p = plan(get_experiment("icr"), "cpu", tmp_path / "out")
    assert len(p.runs) == 10 and len(p.units) == 10 + 16
    first = [(u.kind, u.run.model.label, u.run.seed, u.variant and u.variant.name) for u in p.units[:5]]
    assert first == [("train", "sw-ovq", 0, None), ("eval", "sw-ovq", 0, "base"),
                     ("eval", "sw-ovq", 0, "max_centroids-x2"), ("eval", "sw-ovq", 0, "max_centroids-x4"),
                     ("train", "sw-nope", 0, None)]
    assert p.units[-1].describe() == "eval sw-kvm seed 1" and p.units[3].describe() == "eval sw-ovq seed 0 (N×4)"
    ovq = p.runs[0]
    assert ovq.dir == tmp_path / "out" / "sw-ovq-s0" and ovq.train.out == str(ovq.dir) and ovq.train.seed == 0
    assert ovq.config.mixer_options == {"ovq": {"max_centroids": 128}}  # the paper's rows per pair
    assert [v.overrides for v in ovq.variants] == [{}, {"max_centroids": 256}, {"max_centroids": 512}]
    assert [v.label for v in ovq.variants] == ["sw-ovq", "sw-ovq N×2", "sw-ovq N×4"]
    # the full task options are passed, so the preset's TASK_SCALES cannot change the experiment's task
    assert ovq.train.task_options == p.task.options() and ovq.train.task_options["min_pairs"] == 1
    assert (ovq.train.task_options["key_len"], ovq.train.task_options["value_len"]) == (2, 1)
    assert set(TASK_SCALES["tiny"]["icr"]) <= set(ovq.train.task_options)
    nope = p.runs[1]  # also evaluated with its logits scaled past the training length (the scale's, 64)
    assert [(v.name, v.label, v.overrides) for v in nope.variants] == [
        ("base", "sw-nope", {}), ("logn_len-64", "sw-nope logn_len=64", {"logn_len": 64})]
    assert p.units[6].describe() == "eval sw-nope seed 0 (logn_len=64)"
    kvm = p.runs[4]
    assert kvm.model.label == "sw-kvm" and kvm.config.mixer_options["kvm"]["budget"] == "power_law"
    assert (kvm.train.steps, kvm.train.batch_size, kvm.train.seq_len, kvm.train.ckpt_every) == (2000, 32, 64, 200)
    assert p.runs[5].seed == 1 and p.runs[5].dir.name == "sw-ovq-s1"
    assert [(r.seed, r.train.seed, r.train.out) for r in p.runs[4:6]] == [
        (0, 0, str(tmp_path / "out" / "sw-kvm-s0")), (1, 1, str(tmp_path / "out" / "sw-ovq-s1"))]
    text = p.describe()
    assert "4,096,000 training tokens" in text and "units: 10 train + 16 eval = 26" in text
    assert "notes: the OVQ paper's basic ICR (Figure 4, §8.4) uses 8-token keys" in text
    assert "[26/26] eval sw-kvm seed 1" in text and str(tmp_path / "out" / "sw-kvm-s1" / "eval-base.json") in text
    assert not (tmp_path / "out").exists()  # planning writes nothing


def test_plan_subset_and_spec(tmp_path):
    p = plan(get_experiment("icl"), "smoke", tmp_path, seeds=[3], models=["sw-nope", "sw-ovq"])
    assert [(u.kind, u.run.model.label, u.run.seed) for u in p.units][:2] == [("train", "sw-nope", 3),
                                                                            ("eval", "sw-nope", 3)]
    spec = p.spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["seeds"] == [3] and list(spec["models"]) == ["sw-nope", "sw-ovq"]
    assert spec["train"]["steps"] == 20 and "out" not in spec["train"] and "seed" not in spec["train"]
    assert spec["eval"]["lengths"] == [64, 128] and spec["task_options"]["n_functions"] == 4
    assert spec["models"]["sw-ovq"]["config"]["mixer_options"] == {}  # the OVQ default cap, N = 2048
    assert [v["overrides"] for v in spec["models"]["sw-ovq"]["variants"]] == [
        {}, {"max_centroids": 4096}, {"max_centroids": 8192}]  # the sweep scales the built layer's N
    # where it runs and whether it shows a progress bar do not change results: a resume may differ in them
    moved = plan(get_experiment("icl"), "smoke", tmp_path, seeds=[3], models=["sw-nope", "sw-ovq"], device="cpu",
                 progress=False)
    assert moved.runs[0].train.device == "cpu" and not moved.runs[0].train.progress and moved.spec() == spec
    assert "device" not in spec["train"] and "progress" not in spec["train"]


def test_steps_replace_the_scales_and_are_recorded(tmp_path):
    """``steps`` trains every run for that many steps (warmups and checkpoint interval kept); the spec
    records it, so a resume with other steps is refused (the runner's spec check)."""
    p = plan(get_experiment("icr"), "gpu", tmp_path, seeds=[0], steps=2000)
    assert {r.train.steps for r in p.runs} == {2000} and p.runs[0].train.warmup == 100
    assert p.runs[0].train.length_warmup_steps == 1200  # the length warm-up's steps kept too
    assert p.spec()["train"]["steps"] == 2000 and p.scale.train_tokens == 2000 * 4 * 2048
    text = p.describe()
    assert ("per run: 2,000 steps x 4 x 2048 (first 128, 512 tokens over 1,200 steps) = 16,384,000 "
            "training tokens") in text
    assert "budget: 2,000 steps instead of the scale's 1,700; the scale's: 13.9M training tokens" in text
    with pytest.raises(ValueError, match=r"length_warmup_steps must be in \[2, steps=1200\)"):
        plan(get_experiment("icr"), "gpu", tmp_path, steps=1200)
    assert plan(get_experiment("icr"), "gpu", tmp_path, steps=1700).scale == get_experiment("icr").scale("gpu")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"steps must be an int >= 1, got {bad!r}"):
            plan(get_experiment("icr"), "cpu", tmp_path, steps=bad)


def _exp(scale: Scale, *models: ModelSpec, sweeps=()) -> Experiment:
    return Experiment("t", "test", "icr", models or (ModelSpec("m", "swa,ovq"),), {"s": scale}, sweeps=sweeps)


BASE = dict(preset="tiny", seq_len=64, steps=2, batch_size=2, eval_lengths=(64, 1024))


def test_a_length_without_enough_distinct_keys_fails_at_plan_time(tmp_path):
    """The tiny main job's task (1-token keys and values, vocab 64) cannot fill 1,024 tokens."""
    exp = _exp(Scale(**BASE, task_options=dict(vocab_size=64, key_len=1, value_len=1)))
    with pytest.raises(ValueError, match="eval length 1024 is too long for task .icr.*cannot draw 250 distinct keys"):
        plan(exp, "s", tmp_path)
    ok = _exp(Scale(**BASE, task_options=dict(vocab_size=256, key_len=2, value_len=1)))
    assert plan(ok, "s", tmp_path).task.n_pairs(1024) == 199
    short = _exp(Scale(**{**BASE, "eval_lengths": (16, 64)}, task_options=dict(vocab_size=256, key_len=2, value_len=1)))
    with pytest.raises(ValueError, match="eval length 16 is too short for task 'icr'"):
        plan(short, "s", tmp_path)
    warmup = _exp(Scale(**BASE, task_options=dict(vocab_size=256, key_len=2, value_len=1),
                        train_options=dict(length_warmup=(16,), length_warmup_steps=1)))
    with pytest.raises(ValueError, match="training length 16 is too short for task 'icr'"):  # a warm-up length too
        plan(warmup, "s", tmp_path)


def test_bad_mixer_options_and_overrides_fail_at_plan_time(tmp_path):
    scale = Scale(**BASE, task_options=dict(vocab_size=256, key_len=2, value_len=1))
    bad = ModelSpec("k", "swa,kvm", {"mixer_options": {"kvm": {"bogus": 1}}})
    with pytest.raises(ValueError, match="model 'k': .*'bogus'"):
        plan(_exp(scale, bad), "s", tmp_path)
    with pytest.raises(ValueError, match="model 'm': .*override nonexistent=1"):
        plan(_exp(Scale(**BASE, task_options=scale.task_options, eval_overrides={"nonexistent": 1})), "s", tmp_path)
    nope = ModelSpec("n", "swa,nope")
    with pytest.raises(ValueError, match="no mixer of pattern 'swa,nope' has a test-time 'max_centroids'"):
        plan(_exp(scale, nope, sweeps=(EvalSweep("max_centroids", (1, 2), ("n",)),)), "s", tmp_path)
    mixed = ModelSpec("b", "ovq,kvm", {"mixer_options": {"ovq": {"chunk_size": 32}}})  # kvm's: the config's 16
    with pytest.raises(ValueError, match=r"its mixers have different values \[16, 32\]"):
        plan(_exp(scale, mixed, sweeps=(EvalSweep("chunk_size", (1, 2), ("b",)),)), "s", tmp_path)
    built = ModelSpec("w", "swa,bswa")  # a window layer's chunk_size is read when it is built only
    with pytest.raises(ValueError, match="no mixer of pattern 'swa,bswa' has a test-time 'chunk_size'"):
        plan(_exp(scale, built, sweeps=(EvalSweep("chunk_size", (1, 2), ("w",)),)), "s", tmp_path)


def test_eval_setting_takes_the_scales_training_length_and_is_checked_at_plan_time(tmp_path):
    """``TRAIN_LENGTH`` resolves per scale; a setting no mixer takes, or a value the layer refuses,
    fails when planned (not after training)."""
    gpu = plan(get_experiment("icr"), "gpu", tmp_path, seeds=[0], models=["sw-nope"])
    assert [v.overrides for v in gpu.runs[0].variants] == [{}, {"logn_len": 2048}]
    assert gpu.runs[0].variants[1].label == "sw-nope logn_len=2048"
    assert gpu.spec()["models"]["sw-nope"]["variants"][1] == {"name": "logn_len-2048",
                                                              "label": "sw-nope logn_len=2048",
                                                              "overrides": {"logn_len": 2048}}
    scale = Scale(**BASE, task_options=dict(vocab_size=256, key_len=2, value_len=1))
    ovq = ModelSpec("m", "swa,ovq")
    with pytest.raises(ValueError, match="experiment 't', model 'm': test-time override logn_len=64: no mixer "
                                         "of pattern 'swa,ovq' takes 'logn_len' at test time"):
        plan(_exp(scale, ovq, sweeps=(EvalSetting("logn_len", TRAIN_LENGTH, ("m",)),)), "s", tmp_path)
    nope = ModelSpec("n", "swa,nope")
    with pytest.raises(ValueError,
                       match="model 'n': test-time override logn_len=1: logn_len must be 0 .off. or an int >= 2"):
        plan(_exp(scale, nope, sweeps=(EvalSetting("logn_len", 1, ("n",)),)), "s", tmp_path)
    ok = plan(_exp(scale, nope, sweeps=(EvalSetting("logn_len", 256, ("n",)),)), "s", tmp_path)
    assert [v.overrides for v in ok.runs[0].variants] == [{}, {"logn_len": 256}]


def test_a_sweep_scales_the_value_the_scale_evaluates_with(tmp_path):
    """The scale's test-time overrides apply to every evaluation; a sweep of the same option scales that value
    and its variant's value wins."""
    scale = Scale(**BASE, task_options=dict(vocab_size=256, key_len=2, value_len=1),
                  eval_overrides={"max_centroids": 64})
    p = plan(_exp(scale, sweeps=(EvalSweep("max_centroids", (1, 2), ("m",)),)), "s", tmp_path)
    assert [(v.name, p.eval_overrides(v)) for v in p.runs[0].variants] == [
        ("base", {"max_centroids": 64}), ("max_centroids-x2", {"max_centroids": 128})]
