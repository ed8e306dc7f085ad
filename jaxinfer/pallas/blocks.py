"""Block-size arithmetic shared by the kernels (Triton tiles must be powers of two)."""


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def pow2_at_least(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo)."""
    return max(lo, 1 << max(0, (n - 1).bit_length()))
