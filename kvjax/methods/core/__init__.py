"""What the methods share, below every method: prompt scoring and selection (:mod:`~kvjax.methods.core.select`),
the token scorers (:mod:`~kvjax.methods.core.scorers`), a method that is one score
(:mod:`~kvjax.methods.core.scoring`), a decode budget over any scoring method (:mod:`~kvjax.methods.core.bounded`),
top-k without a sort (:mod:`~kvjax.methods.core.threshold`), batched K-means (:mod:`~kvjax.methods.core.kmeans`)
and host offload (:mod:`~kvjax.methods.core.offload`). These modules import the interface
(:mod:`kvjax.methods.base`) and one another, never a method (tests/test_architecture.py)."""
