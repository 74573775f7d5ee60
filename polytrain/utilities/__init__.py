"""Lightning's ``utilities`` names that projects import: ``rank_zero_only``, ``rank_zero_info``,
``rank_zero_warn``, ``rank_zero_debug``, ``seed_everything``, ``AttributeDict``, ``is_overridden``,
``CombinedLoader``, ``is_picklable``, ``GradClipAlgorithmType``
(``from polytrain.utilities import rank_zero_only``, or ``pl.utilities.rank_zero_only``) and the
exception types (``polytrain.utilities.exceptions.MisconfigurationException``)."""

from polytrain.core.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn
from polytrain.core.rng import seed_everything
from polytrain.data.combined_loader import CombinedLoader
from polytrain.trainer.api.hparams import AttributeDict
from polytrain.utilities.enums import GradClipAlgorithmType
from polytrain.utilities.model_helpers import is_overridden
from polytrain.utilities.parsing import is_picklable

__all__ = ["AttributeDict", "CombinedLoader", "GradClipAlgorithmType", "is_overridden", "is_picklable",
           "rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn", "seed_everything"]
