"""``polytrain.utilities.enums``: Lightning's enum of gradient clipping algorithms (its values are the
strings ``gradient_clip_algorithm`` takes, so either spelling works)."""

from enum import StrEnum


class GradClipAlgorithmType(StrEnum):
    VALUE = "value"
    NORM = "norm"


__all__ = ["GradClipAlgorithmType"]
