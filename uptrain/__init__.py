"""Uptraining converted GQA checkpoints: continued pretraining or distillation from the MHA parent."""

from mha2gqa.uptrain.trainer import OBJECTIVES, TRAINABLE, UptrainResult, UptrainSettings, uptrain

__all__ = ["OBJECTIVES", "TRAINABLE", "UptrainResult", "UptrainSettings", "uptrain"]
