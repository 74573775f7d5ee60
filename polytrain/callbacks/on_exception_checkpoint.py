"""``OnExceptionCheckpoint``: save the state when a stage raises (an error, or Ctrl-C), to resume from it."""

from __future__ import annotations

import logging
import os
from typing import Any

from polytrain.callbacks.base import Callback

log = logging.getLogger("polytrain")


def save_after_exception(trainer: Any, path: str, exception: BaseException) -> bool:
    """Save the trainer's state to ``path`` from ``on_exception``; False where it cannot be done safely.

    On one process the save runs as any other. With several, it is skipped: a save is a collective, and
    the ranks that did not raise are elsewhere (in a collective of their own, or stopping): they would
    never join it, and this rank would wait for them until the timeout."""
    if trainer.world_size > 1:
        log.warning("%s: no checkpoint saved on the exception (%s ranks run: the ranks that did not raise "
                    "cannot join the save)", path, trainer.world_size)
        return False
    trainer.save_checkpoint(path)
    log.info("%s was raised (%s): saved the state at step %s to %s", type(exception).__name__, exception,
             trainer.global_step, path)
    return True


class OnExceptionCheckpoint(Callback):
    """Lightning's ``OnExceptionCheckpoint(dirpath, filename="on_exception")``: when ``fit`` (or another
    stage) raises, the state is saved to ``<dirpath>/<filename>.ckpt``, and ``fit(ckpt_path=...)`` resumes
    from it.

    A file of that name that this callback did not write is never replaced: the save goes to
    ``<filename>-v1.ckpt`` (``-v2``, ...), and ``ckpt_path`` names the file written. A stage that ends
    without an exception removes the file this callback wrote earlier in the process (it is stale), as
    Lightning does; files from other runs stay."""

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError("OnExceptionCheckpoint: the filename cannot be empty")
        # given now, not at setup: an exception can come before any stage has set up
        self.dirpath = os.fspath(dirpath)
        self.filename = filename
        self._written: str | None = None

    @property
    def ckpt_path(self) -> str:
        if self._written is not None:
            return self._written
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def _free_path(self) -> str:
        path, n = os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION), 0
        while os.path.exists(path) and path != self._written:
            n += 1
            path = os.path.join(self.dirpath, f"{self.filename}-v{n}{self.FILE_EXTENSION}")
        return path

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        path = self._free_path()
        if save_after_exception(trainer, path, exception):
            self._written = path

    def teardown(self, trainer: Any, module: Any, stage: str) -> None:
        if self._written is not None and trainer.is_global_zero and os.path.isfile(self._written):
            os.unlink(self._written)
        self._written = None
