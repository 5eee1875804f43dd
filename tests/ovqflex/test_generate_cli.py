"""``ovqflex generate``: a trained run continues a prompt through the decode caches."""
import copy

import pytest
import torch

from ovqflex.cli import main
from ovqflex.training import TrainConfig, train
from ovqflex.training.evaluate import load_run

MODEL = dict(d_model=32, n_heads=2, window=16, chunk_size=16, block_size=16, **{"ovq.max_centroids": 32})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    train(TrainConfig(out=str(out), task="icr", task_options=dict(vocab_size=64, key_len=1, value_len=1), seq_len=64,
                      batch_size=4, steps=2, warmup=1, compile=False, progress=False, model_options=dict(MODEL)))
    return out


def _generated(text: str) -> list[int]:
    line = next(ln for ln in text.splitlines() if ln.startswith("generated:"))
    return [int(v) for v in line.split(":", 1)[1].strip().split(",")]


def test_generate_greedy_continues_like_the_model(run_dir, capsys):
    assert main(["generate", str(run_dir), "--tokens", "3,0,5,7,1,2", "--max-new-tokens", "20",
                 "--temperature", "0"]) == 0
    new = _generated(capsys.readouterr().out)
    _, _, model, _ = load_run(run_dir)
    prompt = torch.tensor([[3, 0, 5, 7, 1, 2]])
    assert new == model.generate(prompt, 20, temperature=0)[0, 6:].tolist()


def test_generate_static_decode_gives_the_functional_tokens(run_dir, capsys):
    """``--decode static``: the in-place caches (HybridLM.generate's fast path; compiled, the same
    step: tests/ovqflex/models/test_static_generate.py); ``graph`` needs CUDA and is refused by name."""
    tokens = ["generate", str(run_dir), "--tokens", "3,0,5,7,1,2", "--max-new-tokens", "40", "--temperature", "0"]
    assert main(tokens) == 0
    want = _generated(capsys.readouterr().out)
    assert main(tokens + ["--decode", "static"]) == 0
    out = capsys.readouterr().out
    assert "decode static" in out and _generated(out) == want
    assert main(tokens + ["--decode", "graph", "--device", "cpu"]) == 2
    assert "decode='graph' replays the decode step from a CUDA graph" in capsys.readouterr().err


def test_generate_samples_with_its_seed_top_k_and_overrides_as_the_model_does(run_dir, capsys):
    """--seed, --top-k, --temperature and --override reach ``HybridLM.generate``: the tokens are the model's own
    under the same generator seed, top-k and test-time override (each of which changes them here)."""
    assert main(["generate", str(run_dir), "--tokens", "3,0,5,7,1,2", "--max-new-tokens", "30", "--temperature",
                 "1.5", "--top-k", "5", "--seed", "7", "--override", "max_centroids=16"]) == 0
    got = _generated(capsys.readouterr().out)
    _, _, model, _ = load_run(run_dir)
    prompt = torch.tensor([[3, 0, 5, 7, 1, 2]])

    def tokens(seed=7, top_k=5, max_centroids=16):
        model.set_overrides(max_centroids=max_centroids)
        gen = torch.Generator().manual_seed(seed)
        return model.generate(prompt, 30, temperature=1.5, top_k=top_k, generator=gen)[0, 6:].tolist()

    assert got == tokens()
    assert got not in (tokens(seed=0), tokens(top_k=None), tokens(max_centroids=32))


def test_a_byte_level_run_takes_a_text_prompt_and_shows_the_text(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "run"
    train(TrainConfig(out=str(out), task="text", data=str(data), seq_len=32, batch_size=2, steps=1, warmup=1,
                      compile=False, progress=False, model_options=dict(MODEL)))
    assert main(["generate", str(out), "--prompt", "the ", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert "prompt tokens: 116,104,101,32\n" in printed
    new = _generated(printed)
    assert len(new) == 8 and f"as text: {bytes(new).decode('utf-8', errors='replace')!r}\n" in printed


def test_a_text_prompt_needs_a_byte_vocabulary():
    from types import SimpleNamespace

    from ovqflex.cli.runs import _prompt_tokens

    args = SimpleNamespace(prompt="hé", tokens=None)
    assert _prompt_tokens(args, 256).tolist() == [[104, 195, 169]]
    with pytest.raises(ValueError, match="--prompt encodes UTF-8 bytes, but the model's vocab_size is 255"):
        _prompt_tokens(args, 255)


def test_generate_int8_runs_and_refuses_bad_prompts(run_dir, capsys, monkeypatch):
    import ovqflex.quantize

    modes, real = [], ovqflex.quantize.quantize_model
    monkeypatch.setattr(ovqflex.quantize, "quantize_model", lambda model, mode: modes.append(mode) or real(model, mode))
    assert main(["generate", str(run_dir), "--tokens", "1,2,3", "--max-new-tokens", "5", "--quantize", "int8",
                 "--top-k", "4", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "quantize int8" in out and len(_generated(out)) == 5 and modes == ["int8"]
    assert main(["generate", str(run_dir), "--prompt", "hi", "--tokens", "1,2"]) == 2
    assert "give exactly one of --prompt TEXT" in capsys.readouterr().err
    assert main(["generate", str(run_dir), "--prompt", "hello"]) == 2  # ICR vocab is below 256
    assert "--prompt encodes UTF-8 bytes" in capsys.readouterr().err
    for ids, bad in (("1,99999", "[99999]"), ("64,1,-1", "[64, -1]")):  # the vocabulary is 0..63
        assert main(["generate", str(run_dir), "--tokens", ids]) == 2
        assert f"--tokens must be non-empty ids in [0, 64), got {bad}" in capsys.readouterr().err
    assert main(["generate", str(run_dir)]) == 2
    assert "exactly one of --prompt" in capsys.readouterr().err


def test_int8_model_agrees_with_fp32_within_stated_tolerance(run_dir):
    """The tolerance stated in ovqflex.quantize: about 1e-2 relative error on the logits."""
    from ovqflex.quantize import quantize_model
    from tests.helpers import rel_err

    _, _, model, _ = load_run(run_dir)
    q = quantize_model(copy.deepcopy(model), "int8")
    assert any("Int8" in type(m.weight).__name__ for m in q.modules() if isinstance(m, torch.nn.Linear))
    tokens = torch.randint(0, model.config.vocab_size, (2, 96))
    with torch.no_grad():
        err = rel_err(q(tokens), model(tokens))
    assert 0 < err <= 2e-2, f"int8 logits relative error {err:.2e}"
    with pytest.raises(ValueError, match="quantize must be one of"):
        quantize_model(model, "int4")
