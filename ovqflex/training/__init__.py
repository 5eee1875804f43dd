"""Training and evaluation: ``train(TrainConfig)``, ``evaluate(run_dir, lengths)``, checkpoints."""
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .evaluate import evaluate, load_run
from .interrupt import TrainingInterrupted
from .trainer import TrainingDiverged, TrainResult, diverged_step, train

__all__ = ["CheckpointError", "TrainConfig", "TrainResult", "evaluate", "latest_checkpoint", "load_checkpoint",
           "load_run", "diverged_step", "save_checkpoint", "train", "TrainingDiverged", "TrainingInterrupted"]
