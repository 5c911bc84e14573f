"""Which platform kernels have been compiled on hardware and checked against their reference.

Written by ``bash scripts/accelerator.sh tests`` (``python3 -m kernels_pallas.impl_choice record JUNIT.xml``), read
by :mod:`kernels_pallas.impl_choice`: ``impl=None`` takes a platform kernel only on a backend recorded here. Per
kernel and backend: None (never verified there) or the implementation, the device kind, the jax version, the date
and how many of its tests passed. Commit the file the device run writes.
"""

VERIFIED = {
    "decode_attention": {
        "gpu": {
            "impl": "pallas_gpu",
            "device_kind": "NVIDIA H200",
            "jax": "0.11.2",
            "date": "2026-11-26",
            "tests": "13/13 passed",
        },
        "tpu": None,
    },
    "pq_lookup": {
        "gpu": {
            "impl": "pallas_gpu",
            "device_kind": "NVIDIA H200",
            "jax": "0.11.2",
            "date": "2026-11-26",
            "tests": "9/9 passed",
        },
        "tpu": None,
    },
    "cosine_kmeans": {
        "gpu": {
            "impl": "pallas_gpu",
            "device_kind": "NVIDIA H200",
            "jax": "0.11.2",
            "date": "2026-11-26",
            "tests": "4/4 passed",
        },
        "tpu": None,
    },
    "chunked_similarity": {
        "gpu": {
            "impl": "pallas_gpu",
            "device_kind": "NVIDIA H200",
            "jax": "0.11.2",
            "date": "2026-11-26",
            "tests": "8/8 passed",
        },
        "tpu": None,
    },
    "accumulated_attention": {"gpu": None, "tpu": None},
    "prefill_attention": {
        "gpu": {
            "impl": "cudnn",
            "device_kind": "NVIDIA H200",
            "jax": "0.11.2",
            "date": "2026-11-26",
            "tests": "4/4 passed",
        },
        "tpu": None,
    },
}
