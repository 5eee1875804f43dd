"""Token-sequence tasks generated on the fly from a seed (docs/design.md §7).

Synthetic long-context tasks of the papers — basic / positional in-context recall
and long ICL linear regression (OVQ paper, arXiv 2602.03922, §8.4–8.5), MQAR and copy (VLA paper, arXiv 2605.11196, §5.2),
needle in a haystack — and language modelling on a byte or uint16 token file::

    task = make_task("icr", vocab_size=512, key_len=2, value_len=2)
    inputs, labels = make_batch(task, seed=0, step=0, start=0, count=32, seq_len=512)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)

``labels[t]`` is what the model must predict at position ``t`` (no shift), ``IGNORE``
where there is no target.
"""
from .assoc import MQAR, Copy
from .base import IGNORE, Task, example_seed, make_batch
from .icl import ICL
from .recall import ICR, NIAH, PICR
from .registry import TASKS, make_task
from .text import Text

__all__ = ["ICL", "ICR", "IGNORE", "MQAR", "NIAH", "PICR", "TASKS", "Copy", "Task", "Text", "example_seed",
           "make_batch", "make_task"]
