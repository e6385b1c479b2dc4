"""The layer engine every stage of a conversion runs on: the model built on ``meta`` and each decoder
layer loaded, run over the windows and emptied again (:mod:`~mha2gqa.convert.engine.layers`); a layer
run with converted K/V heads as the source class reads them (:mod:`~mha2gqa.convert.engine.layer_view`);
and a checkpoint read as another family's (:mod:`~mha2gqa.convert.engine.retarget_view`)."""
