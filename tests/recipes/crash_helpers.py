"""Test components that die at chosen moments (SIGKILL), to test exact and crash-safe resume."""

from __future__ import annotations

import os
import signal

from torchtune.training import FullModelHFCheckpointer
from torchtune.training.metric_logging import DiskLogger


class KillAfterStepLogger(DiskLogger):
    """A DiskLogger that SIGKILLs its own process right after logging ``kill_at_step``."""

    def __init__(self, log_dir: str, kill_at_step: int, **kwargs) -> None:
        super().__init__(log_dir, **kwargs)
        self.kill_at_step = kill_at_step

    def log_dict(self, payload, step: int) -> None:
        super().log_dict(payload, step)
        self._file.flush()
        if step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)


class CrashingCheckpointer(FullModelHFCheckpointer):
    """Writes the model of step ``crash_at_step``, then SIGKILLs itself mid-save."""

    def __init__(self, *args, crash_at_step: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crash_at_step = crash_at_step

    def save_checkpoint(self, state_dict, epoch: int, *args, **kwargs) -> None:
        super().save_checkpoint(state_dict, epoch, *args, **kwargs)
        if epoch == self.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
