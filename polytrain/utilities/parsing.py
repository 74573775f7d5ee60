"""``polytrain.utilities.parsing``: where Lightning keeps ``AttributeDict``."""

from polytrain.trainer.api.hparams import AttributeDict

__all__ = ["AttributeDict"]
