"""Pallas kernels, each beside its pure-JAX reference: ``decode_attention``, ``chunked_similarity``, ``pq_lookup``,
``cosine_kmeans`` (docs/kernels.md; the three tiers: docs/architecture.md#three-kernel-tiers)."""
