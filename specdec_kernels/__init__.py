"""Row-invariant Triton kernels for the target's verify/decode forward.

Every kernel here computes a row's result with one fixed reduction order that depends only on
that row's data (and, for attention, on the row's absolute key positions), never on how many
other rows share the launch. That is what makes a tree verify reproduce a one-row decode bit
for bit in bf16 (the "batch-invariant kernels" idea; shared DOMAIN notes §8). Each kernel has a
torch reference in the same module and tests in tests/kernels/ comparing them on random inputs
(on CPU through ``TRITON_INTERPRET=1``).
"""
