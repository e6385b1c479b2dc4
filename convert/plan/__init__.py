"""What each layer becomes, decided before any tensor is written: the KV-head counts (one for every
layer, given, or chosen per layer by :mod:`~mha2gqa.convert.plan.allocation`), the order of the heads
(:mod:`~mha2gqa.convert.plan.groupings`), and each layer's :class:`~mha2gqa.core.conversion_record.LayerPlan`
(:func:`~mha2gqa.convert.plan.layer_plan.layer_plans`)."""
