"""DCP checkpoints of a training job: the manager that saves, loads and rotates them
(`manager`), their files on disk (`files`), whether one holds only finite numbers (`finite`),
what a save checks and how a failed one ends (`save`), the CPU copy an async save writes from
(`staging`), seeding from another folder (`seed`), and the config's settings kept over a
loaded checkpoint's (`resume`).
"""

from components.checkpoint.manager import (
    CheckpointManager,
    ModelWrapper,
    TrainState,
    complete_checkpoints,
)
from components.checkpoint.save import SaveFailed

__all__ = ["CheckpointManager", "ModelWrapper", "SaveFailed", "TrainState", "complete_checkpoints"]
