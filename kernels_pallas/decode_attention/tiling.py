"""Static check of block shapes against the TPU (Mosaic) tiling rule, so CPU interpret runs catch them.

Mosaic lowers a ``BlockSpec`` only if the last two dims of the block are each either equal to the array's dim
or a multiple of the native tile: 8 (sublanes) for the second-to-last, 128 (lanes) for the last. A 1-D block
must be the full array or a multiple of 128. Interpret mode on CPU accepts any block, so without this check an
illegal shape would only fail on a TPU. The error text follows ``jax._src.pallas.mosaic.lowering``.
"""

from __future__ import annotations

SUBLANES, LANES = 8, 128


def check_block_shape(name: str, array_shape, block_shape) -> None:
    """Raise ``ValueError`` (Mosaic's message) if ``block_shape`` is not TPU-legal for ``array_shape``.

    ``None`` entries of ``block_shape`` are squeezed dims of size 1 (as in ``pl.BlockSpec``).
    """
    array_shape = tuple(int(x) for x in array_shape)
    block = tuple(1 if x is None else int(x) for x in block_shape)
    if len(block) != len(array_shape):
        raise ValueError(
            f"block shape {block_shape} of {name} has rank {len(block)}, array shape {array_shape} "
            f"has rank {len(array_shape)}"
        )
    if len(block) == 0:
        return
    bs0, as0 = block[-1], array_shape[-1]
    bs1, as1 = (block[-2], array_shape[-2]) if len(block) >= 2 else (1, 1)
    if len(block) >= 2:
        ok = (bs0 == as0 or bs0 % LANES == 0) and (bs1 == as1 or bs1 % SUBLANES == 0)
    else:
        ok = bs0 == as0 or bs0 % LANES == 0
    if not ok:
        raise ValueError(
            "The Pallas TPU lowering currently requires that the last two dimensions of your block shape are "
            "divisible by 8 and 128 respectively, or be equal to the respective dimensions of the overall array. "
            f"Block spec for {name} has block shape {block}, array shape {array_shape}. "
            "(kernels_pallas.decode_attention: choose block_size a multiple of 128 or equal to the slot count)"
        )
