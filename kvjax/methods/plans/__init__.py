"""Per-layer plans: which method runs each layer. :mod:`~kvjax.methods.plans.layers` (``PerLayerPlan``,
``FullFirst``, :func:`~kvjax.methods.plans.layers.method_of`) and :mod:`~kvjax.methods.plans.hybrid` (ring buffers of
the window on a hybrid model's local layers)."""
