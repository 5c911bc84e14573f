"""Which platform kernels have been compiled on hardware and checked against their reference.

Written by ``bash scripts/accelerator.sh tests`` (``python3 -m kernels_pallas.impl_choice record JUNIT.xml``), read
by :mod:`kernels_pallas.impl_choice`: ``impl=None`` takes a platform kernel only on a backend recorded here. Per
kernel and backend: None (never verified there) or the implementation, the device kind, the jax version, the date
and how many of its tests passed. Commit the file the device run writes.
"""

VERIFIED = {'decode_attention': {'gpu': None, 'tpu': None},
 'pq_lookup': {'gpu': None, 'tpu': None},
 'cosine_kmeans': {'gpu': None, 'tpu': None},
 'chunked_similarity': {'gpu': None, 'tpu': None},
 'prefill_attention': {'gpu': None, 'tpu': None}}
