"""Qualification tools: the conformance suite, golden vectors and the fault proxy.

They drive the library from outside, as another implementation's test bench would.
"""
