"""``HybridConfig``: every size and mixer option of a :class:`HybridLM`, plus named presets.

Options shared by several mixers (window, chunk size, backend, ...) are fields; options of one
method are ``mixer_options[name]`` (e.g. ``{"ovq": {"max_centroids": 4096}}``), checked against that
method's options at construction. Overrides (:func:`preset`, ``ovqflex train --model-opt``) may
name one method option as ``"ovq.max_centroids"``; they merge into ``mixer_options`` option by option.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from recurrences.checks import (ConfigError, ConfigTypeError, check_block_size, check_choice, check_chunk, check_int,
                                check_keys, check_number, from_dict)

from ..attention import BACKENDS
from ..ops.ovq import OVQOptions


def pattern_names(pattern: str, what: str = "pattern") -> list[str]:
    """The mixer names of a pattern string (``"swa, ovq"`` -> ``["swa", "ovq"]``). An empty name
    (``"swa,,ovq"``, ``"swa,"``, ``""``) is refused, not skipped: it is more often a mixer left out
    than a stray comma; so is a name that is not a mixer (the error lists the mixers)."""
    from .mixers import available_mixers  # (mixers imports this module for HybridConfig)

    names = [m.strip() for m in pattern.split(",")]
    if "" in names:
        raise ValueError(f"{what} must be mixer names separated by single commas (e.g. 'swa,ovq'), "
                         f"got {pattern!r}")
    mixers = available_mixers()
    unknown = [name for name in names if name not in mixers]
    if unknown:
        raise ValueError(f"{what} names unknown mixer {unknown[0]!r}; available: {mixers}")
    return names


@dataclass
class HybridConfig:
    """A hybrid LM: ``n_layers`` blocks whose mixers follow ``pattern`` cyclically.

    ``pattern`` is a comma-separated list of mixer names (``"swa,ovq"`` = the OVQ paper's
    sw-ovq: sliding window with RoPE, then OVQ-attention, repeated; the ``tiny`` preset has
    ``"ovq,swa"``, see :data:`PRESETS`). Attention mixers use the
    paper's unit-norm q/k with a learned per-head ``beta`` when ``qk_norm`` is set.
    """

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 2
    head_dim: int | None = None
    pattern: str = "swa,ovq"
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-5
    qk_norm: bool = True
    qk_conv: int = 0                  # >0: causal depthwise conv of this width on q, k (OVQ paper, arXiv 2602.03922, appendix C)
    rope_base: float = 10000.0
    window: int = 128                 # swa: token window
    chunk_size: int = 128             # ovq / bswa / kvm / vq chunk L
    n_bswa_chunks: int = 2            # bswa / kvm: block window Nb (chunks)
    backend: str = "auto"
    block_size: int = 128             # attention block (flex BLOCK_SIZE / blocked tile)
    init_std: float = 0.02
    mixer_options: dict = field(default_factory=dict)  # one method's options: {"ovq": {"max_centroids": 4096}}

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "window", "n_bswa_chunks"):
            check_int(name, getattr(self, name))
        check_chunk("chunk_size", self.chunk_size)
        check_block_size("block_size", self.block_size)
        if self.head_dim is not None:
            check_int("head_dim", self.head_dim)
        elif self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                             f"(or give head_dim)")
        if not isinstance(self.pattern, str):
            raise ConfigTypeError(f"pattern must be a comma-separated str of mixer names (e.g. 'swa,ovq'), "
                                  f"got {type(self.pattern).__name__} {self.pattern!r}")
        pattern_names(self.pattern)
        check_int("qk_conv", self.qk_conv, minimum=0)
        for name in ("mlp_ratio", "norm_eps", "rope_base"):
            check_number(name, getattr(self, name))
        check_number("init_std", self.init_std, strict=False)
        if not isinstance(self.qk_norm, bool):
            raise ConfigTypeError(f"qk_norm must be True or False, got {type(self.qk_norm).__name__} "
                                  f"{self.qk_norm!r}")
        check_choice("backend", self.backend, BACKENDS)
        self._check_mixer_options()

    def _check_mixer_options(self) -> None:
        """Every ``mixer_options`` entry names a mixer and options its layer takes, with values its
        options dataclass accepts (together with what the config sets); errors name the entry."""
        from ..methods import METHODS  # (the registry imports the layers, which do not need this module)

        if not isinstance(self.mixer_options, dict):
            raise ConfigTypeError(f"mixer_options must be a dict of mixer name -> options dict, "
                                  f"got {type(self.mixer_options).__name__}")
        mixers = {name for name, m in METHODS.items() if m.is_mixer}
        check_keys("mixer_options", self.mixer_options, mixers, error=ConfigTypeError)
        for name, options in self.mixer_options.items():
            what = f"mixer_options[{name!r}]"
            if not isinstance(options, dict):
                raise ConfigTypeError(f"{what} must be a dict of options, got {type(options).__name__}")
            method = METHODS[name]
            check_keys(what, options, method.option_names() - {"options"}, error=ConfigTypeError)
            if method.options is not None:
                known = {f.name for f in dataclasses.fields(method.options)}
                given = {**method.from_config(self), **options}
                try:
                    method.options(**{k: v for k, v in given.items() if k in known})
                except (ValueError, TypeError, ConfigError) as e:
                    raise type(e)(f"{what}: {e}") from None

    @property
    def mixers(self) -> list[str]:
        """The mixer name of every layer: ``pattern`` repeated to ``n_layers``."""
        names = pattern_names(self.pattern)
        return [names[i % len(names)] for i in range(self.n_layers)]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, what: str = "model config") -> "HybridConfig":
        """The config of ``d``; unknown keys (with the nearest valid one), missing keys and wrong
        types are refused by name (``what`` says where ``d`` comes from). ``d`` may name one
        method option as ``"mixer.option"`` (``"ovq.max_centroids"``), and keys of configs saved by
        earlier releases are read with a DeprecationWarning (:func:`canonical_config`)."""
        return from_dict(cls, canonical_config(d, what), what)


#: Keys of configs saved by earlier releases: ``bswa_chunks`` (now ``n_bswa_chunks``) and OVQ's
#: ``max_centroids``, ``growth``, ``seeding`` (now ``mixer_options["ovq"]``).
_RENAMED = {"bswa_chunks": "n_bswa_chunks"}
_MOVED_TO_OVQ = ("max_centroids", "growth", "seeding")


def canonical_config(d: dict, what: str = "model config") -> dict:
    """``d`` (config keys and values, possibly partial) with every method option inside
    ``mixer_options``: a key ``"mixer.option"`` becomes ``mixer_options[mixer][option]``; an
    earlier release's key is renamed or moved, with a DeprecationWarning, and a moved OVQ value
    equal to the :class:`~ovqflex.ops.ovq.OVQOptions` default is dropped (then and now the
    default: the same model, so saved runs still match their presets). One option given twice
    is a ValueError naming it. A ``d`` that is not a dict of that shape is returned unchanged
    (the config's own checks name what is wrong)."""
    if not isinstance(d, dict) or not isinstance(d.get("mixer_options", {}), dict) or not all(
            isinstance(v, dict) for v in d.get("mixer_options", {}).values()):
        return d
    out, moved = {}, []
    nested = {name: dict(opts) for name, opts in d.get("mixer_options", {}).items()}
    for key, value in d.items():
        if key == "mixer_options":
            continue
        if key in _RENAMED:
            if _RENAMED[key] in d:
                raise ValueError(f"{what}: {key!r} is the old name of {_RENAMED[key]!r}, and both are given")
            warnings.warn(f"{what}: {key} is renamed {_RENAMED[key]}", DeprecationWarning, stacklevel=3)
            out[_RENAMED[key]] = value
            continue
        if key in _MOVED_TO_OVQ:
            moved.append(key)
            if value == getattr(OVQOptions, key):
                continue
            mixer, option = "ovq", key
        elif isinstance(key, str) and "." in key:
            mixer, option = key.split(".", 1)
        else:
            out[key] = value
            continue
        if option in nested.get(mixer, {}):
            raise ValueError(f"{what}: {key!r} sets mixer_options[{mixer!r}][{option!r}], which is given twice")
        nested.setdefault(mixer, {})[option] = value
    if moved:
        warnings.warn(f"{what}: {', '.join(moved)} {'is' if len(moved) == 1 else 'are'} now OVQ options: "
                      f"mixer_options['ovq'] (or 'ovq.{moved[0]}' in overrides)", DeprecationWarning, stacklevel=3)
    if nested:
        out["mixer_options"] = nested
    return out


def merge_config(base: dict, overrides: dict, what: str = "model config") -> dict:
    """``base`` config keys updated by ``overrides`` (both as :func:`canonical_config` reads them),
    ``mixer_options`` merged option by option: ``{"ovq": {"max_centroids": 1024}}`` updated by
    ``{"ovq.growth": "full"}`` keeps the cap."""
    base, overrides = canonical_config(base, what), canonical_config(overrides, what)
    merged = {**base, **overrides}
    if isinstance(base.get("mixer_options"), dict) and isinstance(overrides.get("mixer_options"), dict):
        nested = {name: dict(opts) for name, opts in base["mixer_options"].items()}
        for name, opts in overrides["mixer_options"].items():  # (an entry not a dict: the config refuses it)
            nested[name] = {**nested.get(name, {}), **opts} if isinstance(opts, dict) else opts
        merged["mixer_options"] = nested
    return merged


#: Named presets: overrides of the defaults. ``tiny`` learns basic ICR on a 2-core CPU in
#: minutes: 2 layers, width 128, chunks of 16, the OVQ paper's appendix-C q/k convolution
#: (width 4), without which this size does not leave the ICR loss plateau within a CPU
#: budget, and the paper's dictionary cap N = 2048, the OVQ default (with N = 256 the plateau schedule
#: already merges 8 of the first 48 tokens, and runs of 3,000 steps ended at 0.72-0.85).
#: Its recall layer comes first (pattern ``ovq,swa``): its keys are then the q/k convolution
#: of token embeddings, so the only recall it can learn is the direct one (the query ``Kq →``
#: matches the context's ``K → V`` and reads ``V``). After a window layer (``swa,ovq``) it can
#: also match on what the window layer averaged over the last pairs, and which of the two a run
#: learns is decided by float-level noise: seed 0 of the main job attended to the delimiter 7
#: tokens after the queried key (the window's reach), held 0.94 at 64 tokens and fell to 0.06 at
#: 1,024, while seeds 1 and 2 matched the pair itself and held 0.90-0.93 (docs/experiments.md, the main job).
#: Its sliding window is 8 tokens: the window must be a small part of the training context,
#: as in the paper (128 of 4k). With a 32-token window at the 64-token training length (and the
#: window layer first), 55% of the ICR targets have their key inside the window, so training
#: first learned recall through the RoPE window layer and extrapolated poorly
#: (1.00 / 0.56 / 0.34 at 64 / 128 / 256 tokens); with window 8 (6% of the targets) the OVQ
#: layer did the recall: 1.00 / 1.00 / 0.995.
#: ``paper-icr`` is the OVQ paper's synthetic-task model (arXiv 2602.03922, §4.1, §8.2:
#: 8 layers, width 768, head dim 128, window 128, chunk 128, N = 2k, vocab 10k).
PRESETS: dict[str, dict] = {
    "tiny": dict(pattern="ovq,swa", d_model=128, n_layers=2, n_heads=2, window=8, chunk_size=16, block_size=32,
                 qk_conv=4),
    "small": dict(d_model=256, n_layers=4, n_heads=4, window=128, chunk_size=128,
                  mixer_options={"ovq": {"max_centroids": 1024}}),
    "paper-icr": dict(vocab_size=10000, d_model=768, n_layers=8, n_heads=6, head_dim=128, window=128,
                      chunk_size=128),
}


def preset(name: str, **overrides) -> HybridConfig:
    """``HybridConfig`` of preset ``name`` with ``overrides`` applied (e.g. ``pattern``, ``vocab_size``,
    ``mixer_options={"kvm": {...}}``; merged option by option, :func:`merge_config`). A method option
    may be named by its dotted key: ``preset("tiny", **{"ovq.max_centroids": 4096})``."""
    check_preset(name)
    what = f"model config (preset {name!r})"
    return HybridConfig.from_dict(merge_config(PRESETS[name], overrides, what), what)


def check_preset(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return name
