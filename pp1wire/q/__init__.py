"""q math: the dyadic24 contract, the Philox RNG ABI, the exact oracle, proposals and the verifier.

Plain synchronous code with no I/O; everything else in the package builds on it.
"""
