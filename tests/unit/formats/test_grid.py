"""The host-side grid arithmetic against triton's own (constexpr) functions, brute force."""

import triton

from megatron_ext.formats.grid import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_are_tritons():
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 32, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**40 + 1) == 2**41 and cdiv(0, 7) == 0
