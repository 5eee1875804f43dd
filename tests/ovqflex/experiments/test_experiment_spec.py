"""Experiment specs and the registry: validation names what is wrong; the registered
experiments keep the sizes the issue asks for (16x extrapolation, >= 2 seeds, a GPU scale)."""
import pytest

from ovqflex.experiments import (EXPERIMENTS, TRAIN_LENGTH, EvalSetting, EvalSweep, Experiment, ModelSpec, Scale,
                                 get_experiment, plan)
from ovqflex.experiments.registry import register_experiment
from ovqflex.tasks import make_task
from recurrences.ovq.routing import dictionary_size


def scale(**kw) -> Scale:
    return Scale(**{**dict(preset="tiny", seq_len=64, steps=2, batch_size=2, eval_lengths=(64, 128)), **kw})


def test_unknown_experiment_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="unknown experiment 'nope'; known experiments: icl, icr"):
        get_experiment("nope")


def test_unknown_model_and_scale_are_refused_by_name(tmp_path):
    exp = get_experiment("icr")
    with pytest.raises(ValueError, match="no model 'sw-foo'; its models: sw-ovq, sw-nope, sw-vq, sw-linear, sw-kvm"):
        plan(exp, "cpu", tmp_path, models=["sw-ovq", "sw-foo"])
    with pytest.raises(ValueError, match="no scale 'tpu'; its scales: cpu, gpu, smoke"):
        plan(exp, "tpu", tmp_path)
    for seeds in ([0, 0], [True], [-1], []):  # (True is an int to Python, not a seed)
        with pytest.raises(ValueError, match=r"seeds must be distinct ints >= 0, e.g. 0,1; got \("):
            plan(exp, "cpu", tmp_path, seeds=seeds)
    with pytest.raises(ValueError, match=r"models must be distinct labels of sw-ovq, .*; got \['sw-ovq', 'sw-ovq'\]"):
        plan(exp, "cpu", tmp_path, models=["sw-ovq", "sw-ovq"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(label="a/b", pattern="swa"), "ModelSpec.label must be a name"),
    (dict(label=".m", pattern="swa"), r"ModelSpec.label must be a name of letters, digits, '.', '_' or '-' \(it "
                                      r"names files\), got '.m'"),
    (dict(label="m", pattern="swa,ovqq"), r"pattern names unknown mixer 'ovqq'"),
    (dict(label="m", pattern="swa", model_options={"pattern": "ovq"}), "must not set pattern"),
    (dict(label="m", pattern="swa", model_options={"vocab_size": 64}), r"ModelSpec 'm': model_options must not set "
                                                                      r"pattern or vocab_size"),
    (dict(label="m", pattern="swa,,ovq"), r"ModelSpec 'm': pattern must be mixer names separated by single commas "
                                          r"\(e.g. 'swa,ovq'\), got 'swa,,ovq'"),
], ids=["label", "label-dot", "mixer", "pattern-option", "vocab-option", "empty-mixer"])
def test_model_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(preset="huge"), "Scale.preset must be one of"),
    (dict(eval_lengths=(128, 64)), "distinct increasing"),
    (dict(eval_lengths=(64, 64)), r"Scale.eval_lengths must hold distinct increasing values, got \(64, 64\)"),
    (dict(eval_lengths=()), "non-empty tuple"),
    (dict(train_options={"steps": 5}), r"must not set \['steps'\]"),
    (dict(train_options={"seed": 5}), r"must not set \['seed'\]"),
    (dict(train_options={"stepz": 5}), r"TrainConfig fields\): unknown key 'stepz' \(did you mean 'steps'\?\)"),
    (dict(train_options={"grad_clip": -1.0}), "grad_clip must be a finite number >= 0"),
    (dict(eval_examples=0), "eval_examples must be an int >= 1"),
    (dict(eval_batch_size=True), "Scale.eval_batch_size must be an int >= 1, got True"),
    (dict(steps=0), "steps must be >= 1"),
    (dict(budget=3), "Scale.budget must be a str, got 3"),
    (dict(model_options={"vocab_size": 64}), "Scale.model_options must not set pattern or vocab_size"),
    (dict(model_options={"pattern": "swa"}), "Scale.model_options must not set pattern or vocab_size"),
], ids=["preset", "order", "repeated", "empty", "steps", "seed", "unknown", "grad-clip", "examples", "batch-bool",
        "zero-steps", "budget", "vocab", "pattern"])
def test_scale_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        scale(**kwargs)


def test_experiment_validation():
    m = ModelSpec("a", "swa,ovq")
    with pytest.raises(ValueError, match="model labels must be distinct"):
        Experiment("x", "d", "icr", (m, m), {"s": scale()})
    with pytest.raises(ValueError, match="task must be one of"):
        Experiment("x", "d", "icrr", (m,), {"s": scale()})
    with pytest.raises(ValueError, match=r"EvalSweep of max_centroids names unknown model\(s\) \['b'\]"):
        Experiment("x", "d", "icr", (m,), {"s": scale()}, sweeps=(EvalSweep("max_centroids", (1, 2), ("b",)),))
    with pytest.raises(ValueError, match="EvalSweep.option must be a mixer attribute name"):
        EvalSweep("max-centroids", (1, 2), ("a",))
    with pytest.raises(ValueError, match=r"EvalSweep.factors must hold distinct increasing values, got \(1, 4, 2\)"):
        EvalSweep("max_centroids", (1, 4, 2), ("a",))
    with pytest.raises(ValueError, match=r"Experiment 'x': scale name must be a name of letters, digits, .*got 'a/b'"):
        Experiment("x", "d", "icr", (m,), {"a/b": scale()})
    with pytest.raises(ValueError, match=r"EvalSetting of logn_len names unknown model\(s\) \['b'\]"):
        Experiment("x", "d", "icr", (m,), {"s": scale()}, sweeps=(EvalSetting("logn_len", 64, ("b",)),))
    with pytest.raises(TypeError, match="sweeps must be a tuple of EvalSweep or EvalSetting"):
        Experiment("x", "d", "icr", (m,), {"s": scale()}, sweeps=({"logn_len": 64},))
    with pytest.raises(ValueError, match="seeds must hold ints >= 0"):
        Experiment("x", "d", "icr", (m,), {"s": scale()}, seeds=(-1,))
    with pytest.raises(ValueError, match="'icr' is already registered"):
        register_experiment(Experiment("icr", "d", "icr", (m,), {"s": scale()}))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(option="logn-len", value=64), ValueError, "EvalSetting.option must be a mixer attribute name"),
    (dict(option="logn_len", value="64"), ValueError,
     "EvalSetting.value must be an int, a float or 'train_length' .the scale's training length., got '64'"),
    (dict(option="logn_len", value=True), ValueError, "EvalSetting.value must be an int, a float"),
    (dict(option="logn_len", value=64, models=()), TypeError, "EvalSetting.models must be a non-empty tuple"),
    (dict(option="logn_len", value=64, models="sw-nope"), TypeError, "EvalSetting.models must be a non-empty"),
], ids=["option", "value-str", "value-bool", "no-models", "models-str"])
def test_eval_setting_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        EvalSetting(**{"models": ("a",), **kwargs})


def test_a_scales_token_counts():
    s = scale(seq_len=64, steps=10, batch_size=4, eval_lengths=(64, 256, 1024), eval_examples=8)
    assert s.train_tokens == 10 * 4 * 64
    assert s.eval_tokens == 8 * (64 + 256 + 1024)
    assert s.max_ratio == 16


def test_eval_setting_names_and_labels_its_evaluation():
    """Named as ``ovqflex eval --override`` names its report, so an evaluation already made by hand
    with the same override, lengths and examples counts as the experiment's."""
    at_train = EvalSetting("logn_len", TRAIN_LENGTH, ("sw-nope",))
    assert at_train.resolved(2048) == 2048 and at_train.variant_name(2048) == "logn_len-2048"
    assert at_train.variant_label("sw-nope", 64) == "sw-nope logn_len=64"
    fixed = EvalSetting("logn_len", 512, ("sw-nope",))
    assert fixed.resolved(2048) == 512 and fixed.variant_name(64) == "logn_len-512"
    from ovqflex.training.evaluate import report_name
    assert f"eval-{at_train.variant_name(2048)}" == report_name({"logn_len": 2048})


@pytest.mark.parametrize("name", ["icr", "icl"])
def test_registered_experiments_have_the_asked_for_sizes(name):
    exp = EXPERIMENTS[name]
    assert exp.labels == ["sw-ovq", "sw-nope", "sw-vq", "sw-linear", "sw-kvm"]
    assert len(exp.seeds) >= 2 and set(exp.scales) == {"cpu", "gpu", "smoke"}
    cpu, gpu = exp.scale("cpu"), exp.scale("gpu")
    assert cpu.preset == "tiny" and cpu.max_ratio >= 16 and cpu.eval_lengths[0] == cpu.seq_len
    assert gpu.seq_len >= 2048 and gpu.eval_lengths[-1] >= 32768 and gpu.max_ratio >= 16
    # the CPU budget (<= 60 min for all runs): <= 45M training tokens at the tiny model's ~16k tokens/s
    assert 2_000_000 <= cpu.train_tokens and cpu.train_tokens * len(exp.labels) * len(exp.seeds) <= 45_000_000
    sweep, *settings = exp.sweeps  # the paper's dictionary sweep; icr also sw-nope's logits scaled past L
    assert (sweep.option, sweep.factors, sweep.models) == ("max_centroids", (1, 2, 4), ("sw-ovq",))
    assert settings == ([EvalSetting("logn_len", TRAIN_LENGTH, ("sw-nope",))] if name == "icr" else [])


def test_icr_scales_do_not_run_out_of_distinct_keys_or_values():
    """The longest evaluation context still has distinct keys and values (here by the arithmetic;
    planning also generates one sequence at every length)."""
    for name, sc in EXPERIMENTS["icr"].scales.items():
        task = make_task("icr", **sc.task_options)
        pairs = task.n_pairs(sc.eval_lengths[-1])
        content = task.vocab_size - 4
        assert task.key_len >= 2 or name != "gpu", name  # the gpu scale keeps the paper's multi-token keys
        assert pairs <= content ** task.key_len and pairs <= content ** task.value_len, (name, pairs)


def test_icr_gpu_scale_keeps_the_cpu_scales_dictionary_share_of_the_tokens(tmp_path):
    """sw-ovq's dictionary holds about the same share of the context's tokens at each multiple of the
    training length at both scales (the plateau size ``t N / (t + N)`` depends on ``t / N`` alone), so
    the gpu scale compresses as the cpu scale does and its N x2, x4 sweep has something to show."""
    shares = {}
    for name in ("cpu", "gpu"):
        p = plan(get_experiment("icr"), name, tmp_path / name, seeds=[0], models=["sw-ovq"])
        cfg = p.spec()["models"]["sw-ovq"]["config"]
        n, chunk = cfg["mixer_options"]["ovq"]["max_centroids"], cfg["chunk_size"]
        lengths = p.scale.eval_lengths
        assert [t // lengths[0] for t in lengths] == [1, 2, 4, 8, 16], name
        shares[name] = [dictionary_size(t // chunk, chunk, n) / t for t in lengths]
    assert shares["gpu"] == pytest.approx(shares["cpu"], abs=0.02)
    assert shares["gpu"][0] > 0.6 and shares["gpu"][-1] < 0.15  # 2/3 of the tokens at 1x, 11% at 16x
