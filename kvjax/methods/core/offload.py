"""Keeping a recall method's full K/V in host memory (``offload=True`` of PQCache and ClusterKV): the
``pinned_host`` sharding the state's K/V are placed in, and the device one a decode step reads them back into."""

from __future__ import annotations

import jax


def host_sharding():
    """The ``pinned_host`` sharding of the default device, or a ValueError where the backend has none."""
    backend = jax.default_backend()
    dev = jax.devices()[0]
    if backend == "cpu":
        raise ValueError(
            "offload=True is not supported on the CPU backend: the KV already lives in host memory "
            "and there is no separate device memory to offload from; use offload=False on CPU "
            "(offload needs a GPU/TPU backend with a 'pinned_host' memory kind)"
        )
    kinds = {m.kind for m in dev.addressable_memories()}
    if "pinned_host" not in kinds:
        raise ValueError(
            f"offload=True needs the 'pinned_host' memory kind, but device {dev} offers "
            f"{sorted(kinds)}; use offload=False"
        )
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


def device_sharding():
    """The default device's own memory: where an offloaded K/V is read back to for a decode step's attention."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
