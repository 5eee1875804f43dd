"""Models: :class:`HybridLM` and its config, presets and mixers (read from ``ovqflex.methods``)."""
from .config import PRESETS, HybridConfig, preset
from .hybrid import HybridLM
from .mixers import available_mixers, build_mixer

__all__ = ["PRESETS", "HybridConfig", "HybridLM", "available_mixers", "build_mixer", "preset"]
