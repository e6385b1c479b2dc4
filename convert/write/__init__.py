"""Writing the converted checkpoint: where every output tensor comes from, following each layer's plan
(:mod:`~mha2gqa.convert.write.tensor_sources`), and the shards written one tensor at a time into a
staged folder (:mod:`~mha2gqa.convert.write.shard_writer`)."""
