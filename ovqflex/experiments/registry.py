"""The named experiments: ``icr`` and ``icl``, the synthetic long-context comparisons of
"Online Vector Quantized Attention" (arXiv 2602.03922, §4.1, Figures 4-5, appendix §8.4-8.5)
at sizes a CPU or one GPU can run.

Models (``HybridLM`` mixer patterns: one mixer alternating with a sliding window, the mixer first, as
in the ``tiny`` preset; the paper's names say "sw-" for the interleave, whose order it does not fix):

- ``sw-ovq`` ``ovq,swa`` -- OVQ-attention, dictionary cap ``N`` = the preset's (``tiny``: the OVQ default 2048);
  also evaluated with ``N`` ×2 and ×4 at test time (the paper's dictionary sweep: it finds
  that more memory at test time always helps).
- ``sw-nope`` ``nope,swa`` -- full causal attention without positions (the paper's strongest baseline);
  in ``icr`` also evaluated with ``logn_len`` = the training length (its logits scaled by
  ``ln(t + 1) / ln L`` past the training length ``L``, a test-time setting: below, the ``gpu`` scale).
- ``sw-vq`` ``vq,swa`` -- VQ-attention (Transformer-VQ), codebook of 512 (the layer's default).
- ``sw-linear`` ``linear,swa`` -- linear attention (ELU+1 features).
- ``sw-kvm`` ``kvm,swa`` -- Key-Value Means with the growing power-law state ``16 sqrt(ctx)`` rows, uncapped.

Scales (``ovqflex experiment NAME --scale S``):

- ``cpu`` -- the ``tiny`` preset. ``icr``: trained at 64 tokens, evaluated at 64 ... 1,024 (16×),
  2,000 steps of 32 × 64 tokens (4.1M per run); ``icl``: trained at 128, evaluated at
  128 ... 2,048 (16×), 2,000 steps of 16 × 128 (4.1M per run). Measured for all 5 models
  × 2 seeds with their evaluations (64 examples per length: 127k tokens for icr, 254k for
  icl), two runs at a time (``--jobs 2``, one thread each) on a quiet 2-core CPU: icr 25 min
  (3.1-7.5 min per training run), icl 29 min (3.1-7.6 min per training run).
- ``gpu`` -- ``icr``: the ``tiny`` preset with ``N`` = 4,096, trained at 2,048 tokens (1,700 steps
  of 4 sequences, 13.9M tokens per run; its first 1,200 steps at 128 and 512 tokens, 600 each with
  64 and 16 sequences: the length warm-up, :func:`ovqflex.training.schedule.length_at`) and
  evaluated at 2k ... 32k (16×). ``N`` = 4,096 keeps the ``cpu`` scale's dictionary share of the
  context at every multiple of the training length, since the plateau size ``t N / (t + N)``
  depends on ``t / N`` alone: the last chunk reads 1,358 rows at 2k (2/3 of the tokens before it)
  and 3,640 at 32k (11%). Sized for the GPU time this project is lent (minutes a session, at most
  10 a command): 139M training tokens for the 10 runs, where the train bench's ``tiny`` sw-ovq at
  2,048 tokens ran at 1.37M tokens/s on an H100 (batch 16); its GPU time is not measured. Why
  these settings, measured with ``tiny`` models on the 2-core CPU (seed 0, lr 5e-3, this task):

  - Trained at 512 tokens alone (batch 16, 1,000 steps) sw-ovq stayed on the no-recall plateau
    (loss ln 252) throughout; at 128 tokens it learned in 300-400 steps with batch 32, by step 200
    with 64, not by step 700 with 16; with ``--length-warmup 128 --length-warmup-steps 400`` (batch
    64 at 128, then 16 at 512) it left the plateau by step 200 and evaluated 0.997 at 512 and
    0.949 at 2,048 (docs/experiments.md, a length warm-up). With lr 1e-3 at 128 tokens (batch 64) it
    reached accuracy 0.24 in 600 steps, where 5e-3 had 0.82 by step 200.
  - With ``N`` = 1,024 (682 rows at 2k, a third of the tokens; ``ovqflex train --seq-len 2048
    --length-warmup 128,512 --length-warmup-steps 500 --steps 800 --batch-size 4 --model-opt
    ovq.max_centroids=1024`` with the task options below) sw-ovq left the plateau at 128 tokens by
    step 210 and held 0.98-1.00 at 512, but only 0.6-0.75 training accuracy at 2,048; evaluated on
    32 examples it scored 0.98 / 0.87 / 0.22 at 512 / 2k / 8k, and 1.00 / 0.99 / 0.84 with ``N`` =
    4,096 at test time: the dictionary, not the learning, was the limit.
  - The scale's first form had 250 steps at each warm-up length (1,000 steps in all). sw-ovq
    trained in 26 min (``ovqflex experiment icr --scale gpu --models sw-ovq --seeds 0 --device
    cpu``): training accuracy 0.94-0.98 at 2,048 tokens; evaluated 0.975 / 0.871 / 0.607 / 0.236 /
    0.040 at 2k / 4k / 8k / 16k / 32k, and with ``N`` ×2 0.991 / 0.961 / 0.870 / 0.547 to 16k. But
    in its pilot (``ovqflex pilot icr --scale gpu --models sw-nope,sw-vq --lrs 5e-3 --stop-after
    250``) sw-nope left the plateau at step 190, as sw-ovq had, while sw-vq had not by step 250
    (accuracy 0.011; it needed 300-310 steps at the ``cpu`` scale), so the warm-up lengths now have
    600 steps each. In the pilot of this form
    (``--stop-after 600``; each run's training accuracy at 128 tokens first reached 0.5 at the step
    given) sw-kvm left at step 210, sw-linear at 320 (0.73 at 600) and sw-vq at 390 (0.88 at 600).
    This form's sw-ovq (the experiment command above, 28 min 41 s of training) evaluated 0.922 /
    0.794 / 0.503 / 0.227 / 0.049 at 2k ... 32k with seed 0 (N ×4: 0.990 / 0.971 / 0.895 / 0.708 /
    0.397), below the shorter form at N ×1, and 0.987 / 0.931 / 0.727 / 0.307 / 0.044 with seed 1
    (``--seeds 1``), above it: the seeds differ by more than the two forms do. The lower lr at
    which this form's 2,048-token phase starts (1.1e-3, against 2.9e-3) is not what held seed 0
    back: with ``--steps 2000`` (800 steps at 2,048, from lr 1.9e-3) seed 0 did worse, training
    accuracy 0.70 at 2,048 and 0.770 / 0.643 / 0.419 / 0.186 / 0.047 evaluated.
  - All five models at this scale ran on the CPU (``--device cpu --jobs 2``; docs/experiments.md,
    icr at the gpu scale): sw-nope held 0.99 at 2x and fell to 0.13 at 16x, below sw-ovq with ``N`` x4 (0.37),
    because its NoPE layer's softmax spreads over 16x more keys (``ovqflex probe``: the queried pair
    keeps the top logit, its weight falls as 1/T); scaling that layer's logits at test time
    (``ovqflex eval --override logn_len=2048``; the experiment's line ``sw-nope logn_len=2048``) restored
    0.95 at 16x. sw-vq (512 codes), sw-linear and sw-kvm were below sw-ovq at the training length;
    sw-kvm's state, not its attention, was its limit (a larger state at test time lifted both seeds).
  - Before, the scale was the ``small`` preset (4 layers, width 256, window and chunk 128, ``N`` =
    1,024) for 5,000 steps of 16 sequences: 164M tokens a run, an estimated 2-3 h of an H100 for
    the table, never run. ``small`` also learned more slowly: a ``small`` sw-ovq at 256 tokens
    (batch 32, lr 2e-3) was still on the plateau at step 425 (loss 5.52) when stopped.

  Whether every model leaves the plateau within the first warm-up length on the GPU too (bf16
  autocast there) is one command before whole runs: ``ovqflex pilot icr --scale gpu --lrs 5e-3
  --stop-after 600`` (``bash tools/gpu_check.sh pilot OUT``).
  ``icl``: the ``small`` preset with the q/k convolution of width 4, 5,000 steps of 16 × 2,048
  tokens on the paper's task size, never run (a smaller task learned nothing on the CPU: below).
- ``smoke`` -- 20 steps of 8 × 64 tokens, evaluated at 64 and 128 on 8 examples: checks
  the whole pipeline in a few minutes (it learns nothing).

``icr`` at the ``cpu`` scale: 2-token keys and 1-token values of a 256-token vocabulary (63,504
possible keys; a 1,024-token context holds 199 pairs + 6 queries with distinct keys and values),
with the training-only mix of context sizes ``min_pairs=1`` (:class:`ovqflex.tasks.recall.ICR`).
sw-ovq's dictionary cap is ``N = 128`` (``Scale.model_options``): with the plateau schedule that
gives the paper's rows per context pair at both ends -- about 5 rows per pair at the training length
(34 rows for the 7 pairs of 64 tokens; the paper's N = 2k at 4k: 1,365 rows for ~230 pairs of
8-token keys and values, 18 tokens each when laid out as here, ~6) and about 0.6 at 16x (113 rows
for 199 pairs; the paper's at 64k: ~2k rows for ~3.6k pairs, 0.55) -- so the dictionary compresses
as it does in the paper and the test-time sweep (N x2, x4) has something to show. Two pilot runs of
sw-ovq seed 0 (``ovqflex train --task-opt key_len=2 --model-opt ovq.max_centroids=N``, evaluated at
64 / 256 / 1,024 with N x1 / x2 / x4): N = 64: 0.98 / 0.74 / 0.07, 0.99 / 0.94 / 0.35, 0.99 / 0.99 /
0.72; N = 256: 0.95 / 1.00 / 0.57, 0.95 / 1.00 / 0.89, 0.95 / 1.00 / 1.00. The main job (the
``tiny`` preset's task) keeps 1-token keys and N = 2,048; the table with that task for all five
models is in the README's history (commit d62a22a: every model but sw-linear >= 0.92 at 16x, the
sweep changed nothing). At the ``gpu`` scale keys and values are 2 tokens of the same 256-token
vocabulary (63,504 distinct keys and values for the 5,455 pairs of 32k), also with ``min_pairs=1``.
It had a 1,024-token vocabulary, which a ``tiny`` sw-ovq did not learn to recall: on the CPU
(``ovqflex train --seq-len 128 --batch-size 32 --steps 600 --task-opt key_len=2 --task-opt value_len=2
--task-opt min_pairs=1 --task-opt vocab_size=V``, 2026-11-28), V = 1,024 stayed on the no-recall
plateau (loss 6.90, accuracy 0.003 at step 600) where V = 256 reached accuracy 0.70 at step 300 and
1.00 at 600 (1-token values: 0.91 at 400 with V = 256, 0.00 at 600 with V = 1,024).

``icl`` at the ``cpu`` scale: 2-token inputs (the smallest ``io_len`` with a permutation to
infer), 4 functions out of 16 id tokens, ``a, b <= 3`` and ``x <= 16`` (outputs <= 51) in a
256-token vocabulary, with the training-only mix of function counts ``min_functions=1``
(:class:`ovqflex.tasks.icl.ICL`); 21 examples at 128 tokens, ~5 per function. The first
scale (4-token inputs, ``a, b <= 5``, ``x <= 75``, vocab 512, 1,200 steps) learned nothing:
sw-nope and sw-ovq ended at accuracy 0.05-0.10 and did not even get the last output token,
which the earlier outputs of the same example determine (0.18; a model that learned the
arithmetic within one example gets it always, and ~0.46 of all targets without reading any
earlier example). With small arithmetic the tiny models, with the window layer first, learned the
within-example part and the in-context ``a, b``, but not the in-context permutation (see the ICL
docstring for the measured runs); with each mixer first, one seed of the five models separated:
the attention hybrids' accuracy rose with the context, sw-linear's did not (README).
"""
from __future__ import annotations

from .spec import TRAIN_LENGTH, EvalSetting, EvalSweep, Experiment, ModelSpec, Scale

EXPERIMENTS: dict[str, Experiment] = {}


def register_experiment(experiment: Experiment) -> Experiment:
    """Add ``experiment`` to :data:`EXPERIMENTS` under its name (``ValueError`` if taken)."""
    if not isinstance(experiment, Experiment):
        raise TypeError(f"register_experiment takes an Experiment, got {type(experiment).__name__}")
    if experiment.name in EXPERIMENTS:
        raise ValueError(f"an experiment named {experiment.name!r} is already registered")
    EXPERIMENTS[experiment.name] = experiment
    return experiment


def get_experiment(name: str) -> Experiment:
    """The registered experiment ``name``; ``ValueError`` listing the known names otherwise."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known experiments: {', '.join(sorted(EXPERIMENTS))}")
    return EXPERIMENTS[name]


MODELS = (
    ModelSpec("sw-ovq", "ovq,swa"),
    ModelSpec("sw-nope", "nope,swa"),
    ModelSpec("sw-vq", "vq,swa"),
    ModelSpec("sw-linear", "linear,swa"),
    ModelSpec("sw-kvm", "kvm,swa", {"mixer_options": {"kvm": {"budget": "power_law", "growth_factor": 16.0,
                                                              "growth_exponent": 0.5, "max_state_chunks": None}}}),
)
DICTIONARY_SWEEP = EvalSweep("max_centroids", (1, 2, 4), ("sw-ovq",), symbol="N")
#: the NoPE layer's softmax spreads over the longer context's keys; logn_len at the training length
#: keeps a match's weight (module docstring: the gpu scale)
LOGN_SETTING = EvalSetting("logn_len", TRAIN_LENGTH, ("sw-nope",))


def _smoke(task_options: dict) -> Scale:
    return Scale(preset="tiny", seq_len=64, steps=20, batch_size=8, eval_lengths=(64, 128), task_options=task_options,
                 warmup=5, ckpt_every=10, eval_examples=8, eval_batch_size=8,
                 budget="a few minutes for 2 models x 1 seed (compilation dominates); it learns nothing")


_ICR_CPU_TASK = dict(vocab_size=256, key_len=2, value_len=1, n_queries=6, min_pairs=1)
_ICR_CPU_MODEL = {"ovq.max_centroids": 128}  # the paper's rows per pair (module docstring)
# the gpu scale's task stays on its no-recall plateau when trained at its length alone (module docstring)
_ICR_GPU_WARMUP = {"length_warmup": (128, 512), "length_warmup_steps": 1200}
_ICR_GPU_MODEL = {"ovq.max_centroids": 4096}  # the cpu scale's N per training token (module docstring)
register_experiment(Experiment(
    name="icr",
    description="basic in-context recall; accuracy from the training length to 16x it",
    task="icr",
    models=MODELS,
    scales={
        "cpu": Scale(preset="tiny", seq_len=64, steps=2000, batch_size=32, eval_lengths=(64, 128, 256, 512, 1024),
                     task_options=_ICR_CPU_TASK, model_options=_ICR_CPU_MODEL, lr=5e-3, warmup=100,
                     ckpt_every=200, eval_examples=64, eval_batch_size=16,
                     budget="4.1M training tokens per run; measured 25 min for 5 models x 2 seeds with evaluations on "
                            "a quiet 2-core CPU with --jobs 2 (10-23k tokens/s per run, one thread each)"),
        "gpu": Scale(preset="tiny", seq_len=2048, steps=1700, batch_size=4,
                     eval_lengths=(2048, 4096, 8192, 16384, 32768),
                     task_options=dict(vocab_size=256, key_len=2, value_len=2, n_queries=6, min_pairs=1),
                     model_options=_ICR_GPU_MODEL, lr=5e-3, warmup=100, ckpt_every=200, eval_examples=64,
                     eval_batch_size=4, train_options=_ICR_GPU_WARMUP,
                     budget="13.9M training tokens per run; not measured on a GPU (on the 2-core CPU, two runs at "
                            "a time with one thread each: 14-52 min of training per run, up to 14 min per evaluation)"),
        "smoke": _smoke(_ICR_CPU_TASK),
    },
    sweeps=(DICTIONARY_SWEEP, LOGN_SETTING),
    notes="the OVQ paper's basic ICR (Figure 4, §8.4) uses 8-token keys and values of a 10k vocabulary, 8 layers "
          "of width 768, trained at 0.5k-4k and tested to 64k; the cpu scale keeps multi-token keys and the "
          "dictionary's rows per pair at tiny size",
))

_ICL_CPU_TASK = dict(vocab_size=256, io_len=2, n_functions=4, n_function_tokens=16, a_max=3, b_max=3, x_max=16,
                     min_functions=1)
_ICL_GPU_MODEL = {"qk_conv": 4}
register_experiment(Experiment(
    name="icl",
    description="long in-context linear regression; accuracy from the training length to 16x it",
    task="icl",
    models=MODELS,
    scales={
        "cpu": Scale(preset="tiny", seq_len=128, steps=2000, batch_size=16,
                     eval_lengths=(128, 256, 512, 1024, 2048), task_options=_ICL_CPU_TASK, lr=5e-3, warmup=100,
                     ckpt_every=200, eval_examples=64, eval_batch_size=16,
                     budget="4.1M training tokens per run; measured 29 min for 5 models x 2 seeds with "
                            "evaluations on a quiet 2-core CPU with --jobs 2: sw-nope / sw-linear 3.1-3.7 min per "
                            "run (21-22k tokens/s), sw-ovq / sw-vq / sw-kvm 5.0-7.6 min (10-14k tokens/s)"),
        "gpu": Scale(preset="small", seq_len=2048, steps=5000, batch_size=16,
                     eval_lengths=(2048, 4096, 8192, 16384, 32768),
                     task_options=dict(vocab_size=10000, io_len=12, n_functions=16), model_options=_ICL_GPU_MODEL,
                     lr=1e-3, warmup=200, ckpt_every=500, eval_examples=64, eval_batch_size=4,
                     budget="164M training tokens per run; not measured (no GPU here); the paper's task size, "
                            "never run here (a smaller one learned nothing on the CPU: module docstring); try "
                            "`ovqflex pilot icl --scale gpu` first"),
        "smoke": _smoke(_ICL_CPU_TASK),
    },
    sweeps=(DICTIONARY_SWEEP,),
    notes="the OVQ paper's long ICL (Figure 5, §8.5) trains at 2k with 16 functions of 12-token inputs (vocab 10k) "
          "and tests up to 128 functions; here the function count is fixed and the context grows, so later "
          "examples have more earlier examples of their function to learn from",
))
