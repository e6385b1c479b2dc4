"""The serving wing: what a model costs to serve, for ``mha2gqa plan`` and ``mha2gqa inspect``
(parameters and KV-cache bytes from a config, GPU presets, a memory-bandwidth roofline, capacity
tables, and a measured ``bench`` record read back). It builds on :mod:`mha2gqa.core` alone."""
