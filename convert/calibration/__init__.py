"""Calibration for activation-aware merging: statistics, the layer-by-layer engine, grouping."""
