"""``ovqflex probe``: the attention weights it reads are the layers' own, and its statistics locate
the queried pair."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ovqflex.attention import attend
from ovqflex.cli import main
from ovqflex.layers.ovq import OVQAttention
from ovqflex.layers.plain import CausalAttention, SlidingWindowAttention
from ovqflex.ops.ovq import ovq_attention
from ovqflex.tasks import make_batch
from ovqflex.tasks.recall import ASSIGN, ICR
from ovqflex.training import TrainConfig, probe, train
from ovqflex.training.probe import dense_attention, layer_attention, pair_statistics, probe_run, recall_queries


def _every_query(B: int, T: int) -> torch.Tensor:
    """``[B * T, 2]`` rows (example, position) of every query."""
    return torch.cartesian_prod(torch.arange(B), torch.arange(T))


def _apply(w: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Weights ``[Q, H, T]`` applied to each query's example's values ``v`` ``[B, H, T, Dv]``."""
    return torch.einsum("qhk,qhkd->qhd", w, v[rows[:, 0]])


@pytest.mark.parametrize("layer", [CausalAttention(32, 2, qk_norm=True, block_size=16),
                                   SlidingWindowAttention(32, 2, window=5, qk_norm=True, block_size=16),
                                   SlidingWindowAttention(32, 2, window=4, n_sinks=2, block_size=16)],
                         ids=["nope", "window", "window-sinks"])
def test_dense_weights_give_the_layers_attention_output(layer):
    torch.manual_seed(0)
    x = torch.randn(2, 37, 32)
    program = layer.program(x)
    T = x.shape[1]
    rows = _every_query(2, T)
    w = dense_attention(program, rows)
    assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-6)
    out = attend(program, "blocked")
    assert torch.allclose(_apply(w, program.v[:, :, :T], rows), out[rows[:, 0], :, rows[:, 1]], atol=1e-5)
    some = torch.tensor([[1, 0], [0, 36], [1, 5], [0, 5], [1, 36]])  # a subset, in any order
    assert torch.allclose(dense_attention(program, some), w[some[:, 0] * T + some[:, 1]], atol=1e-6)


def test_dense_weights_add_a_programs_bias():
    """A token-only program carrying a per-row bias (``build_program`` gives one to state rows only; the
    backends add any program's): the weights are the biased softmax, the blocked backend's output."""
    torch.manual_seed(2)
    layer = SlidingWindowAttention(32, 2, window=6, block_size=16)
    x = torch.randn(2, 37, 32)
    plain = layer.program(x)
    program = dataclasses.replace(plain, bias=torch.randn(2, 2, plain.geom.kv_len))
    rows = _every_query(2, 37)
    w = dense_attention(program, rows)
    out = attend(program, "blocked")
    assert torch.allclose(_apply(w, program.v[:, :, :37], rows), out[rows[:, 0], :, rows[:, 1]], atol=1e-5)
    assert not torch.allclose(w, dense_attention(plain, rows), atol=1e-3)


def test_ovq_weights_are_its_exact_token_attention():
    """With one dictionary row per token (growth "full", cap >= T) the OVQ op attends to every
    earlier token exactly, so its output is the probe's weights applied to v."""
    torch.manual_seed(1)
    layer = OVQAttention(32, 2, chunk_size=16, max_centroids=64, growth="full", block_size=16, qk_conv=3)
    with torch.no_grad():
        layer.beta.uniform_(3.0, 9.0)
    x = torch.randn(2, 40, 32)
    rows = _every_query(2, 40)
    w = layer_attention(layer, x, rows)
    q, k, v = layer.split_heads(x)
    out = ovq_attention(q, k, v, layer.beta, backend="blocked", options=layer.options)
    assert torch.allclose(_apply(w, v, rows), out[rows[:, 0], :, rows[:, 1]], atol=1e-5)


def test_state_programs_are_refused():
    layer = OVQAttention(32, 2, chunk_size=16, max_centroids=8, block_size=16)
    with pytest.raises(ValueError, match="token rows only"):
        dense_attention(layer.program(torch.randn(1, 40, 32)), torch.tensor([[0, 39]]))


@pytest.mark.parametrize("key_len", [1, 2])
def test_recall_queries_find_each_queried_key_in_the_context(key_len):
    task = ICR(vocab_size=64, key_len=key_len, value_len=2, n_queries=4)
    x, y = make_batch(task, seed=3, step=0, start=0, count=5, seq_len=96)
    q = recall_queries(x, y, key_len)
    assert len(q) == 5 * 4
    for b, t, j in q.tolist():
        assert x[b, t] == ASSIGN and y[b, t] != -100  # the position that predicts the first value token
        assert torch.equal(x[b, j:j + key_len], x[b, t - key_len:t]) and x[b, j + key_len] == ASSIGN
        assert j + task._pair_len() <= (x[b] == 3).nonzero()[0, 0] + 1  # in the context, before the query token


def test_pair_statistics_locate_the_weight():
    Q, H, T = 4, 2, 30
    key_start = torch.tensor([0, 5, 9, 12])
    rows = torch.zeros(Q, H, T)
    rows[torch.arange(Q), 0, key_start + 2] = 0.75  # head 0: on the pair's value token
    rows[torch.arange(Q), 0, key_start + 8] = 0.25
    rows[torch.arange(Q), 1, key_start + 7] = 1.0  # head 1: 7 tokens after the key, outside the pair
    rows[3, 1] = 0
    rows[3, 1, 12 + 3] = 1.0  # one query of head 1 on the pair's delimiter
    (med0, q10_0, off0), (med1, q10_1, off1) = pair_statistics(rows, key_start, pair_len=4)
    assert (med0, q10_0, off0) == (0.75, 0.75, [(2, 1.0)])
    assert med1 == 0.0 and off1 == [(7, 0.75), (3, 0.25)]
    # the pair is its pair_len tokens from the key's first: the last of them is on it, the one after is not
    edges = torch.zeros(Q, 2, T)
    edges[torch.arange(Q), 0, key_start + 3] = 1.0
    edges[torch.arange(Q), 1, key_start + 4] = 1.0
    (last, _, at_last), (after, _, at_after) = pair_statistics(edges, key_start, pair_len=4)
    assert (last, at_last, after, at_after) == (1.0, [(3, 1.0)], 0.0, [(4, 1.0)])


def test_pair_statistics_spread_and_top_offsets():
    """Eleven queries putting 0.0, 0.1, ..., 1.0 on the pair (the rest 8 tokens on): median 0.5, 10th percentile
    0.1 (linear interpolation, as torch.quantile); the most-weighted token at two offsets, of which ``top=1``
    keeps the more frequent."""
    Q, T = 11, 40
    key_start = torch.zeros(Q, dtype=torch.long)
    share = torch.linspace(0, 1, Q)
    rows = torch.zeros(Q, 1, T)
    rows[:, 0, 1] = share
    rows[:, 0, 8] = 1 - share
    (median, q10, offsets), = pair_statistics(rows, key_start, pair_len=4, top=1)
    assert median == pytest.approx(0.5) and q10 == pytest.approx(0.1)
    assert offsets == [(1, 6 / 11)]  # 0.5 .. 1.0 on the pair: token 1 the most weighted (at 0.5 the first max)
    assert pair_statistics(rows, key_start, pair_len=4, top=3)[0][2] == [(1, 6 / 11), (8, 5 / 11)]


def test_pair_statistics_name_three_offsets_by_default():
    """What ``ovqflex probe`` prints: the three most frequent offsets of the most-weighted token (a tie in
    offset order), of four here."""
    Q = 11
    where = torch.tensor([1] * 4 + [2] * 3 + [9] * 2 + [3] * 2)
    rows = torch.zeros(Q, 1, 20)
    rows[torch.arange(Q), 0, where] = 1.0
    (_, _, offsets), = pair_statistics(rows, torch.zeros(Q, dtype=torch.long), pair_len=4)
    assert offsets == [(1, 4 / 11), (2, 3 / 11), (3, 2 / 11)]


def test_probe_command_on_a_trained_run(tmp_path, capsys, monkeypatch):
    cfg = TrainConfig(out=str(tmp_path / "run"), task="icr", task_options=dict(vocab_size=64, key_len=1, value_len=1),
                      seq_len=64, batch_size=4, steps=2, warmup=1, compile=False, progress=False,
                      model_options=dict(d_model=32, n_heads=2, window=8, chunk_size=16, block_size=16))
    train(cfg)
    doc = probe_run(cfg.out, 128, n_examples=3, batch_size=2)
    assert doc["queries"] == 3 * 6 and doc["length"] == 128 and doc["pattern"] == "ovq,swa"
    assert [(h["layer"], h["mixer"], h["head"]) for h in doc["heads"]] == [(0, "ovq", 0), (0, "ovq", 1),
                                                                             (1, "swa", 0), (1, "swa", 1)]
    assert all(0 <= h["pair_weight_q10"] <= h["pair_weight"] <= 1 for h in doc["heads"])
    # accuracy: of the first value token of each query, read from the model's logits there
    real = probe.forward_loss
    for shift, want in ((0, 1.0), (1, 0.0)):
        def answer(model, x, y, _):  # the model's run (its layers' inputs are probed), the logits replaced
            logits, loss = real(model, x, y, None)
            return F.one_hot((y.clamp(min=0) + shift) % logits.shape[-1], logits.shape[-1]).float(), loss

        monkeypatch.setattr(probe, "forward_loss", answer)
        assert probe_run(cfg.out, 128, n_examples=3, batch_size=2)["accuracy"] == want
    monkeypatch.undo()
    assert main(["probe", cfg.out, "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert "64 tokens: 12 queries" in out and "most-weighted token" in out
    assert main(["probe", cfg.out, "--length", "4096"]) == 2
    assert "probe length 4096 is too long" in capsys.readouterr().err
    assert main(["probe", cfg.out, "--examples", "0"]) == 2
    assert "n_examples must be an int >= 1, got 0" in capsys.readouterr().err


def test_probe_refuses_other_tasks(tmp_path):
    cfg = TrainConfig(out=str(tmp_path / "run"), task="copy", seq_len=32, batch_size=2, steps=1, warmup=1,
                      compile=False, progress=False, model_options=dict(d_model=32, n_heads=2, chunk_size=16,
                                                                        block_size=16))
    train(cfg)
    with pytest.raises(ValueError, match="icr task, got task 'copy'"):
        probe_run(cfg.out)
