"""pp1wire: transport, validation and exact verification for sampled speculative decoding."""

__version__ = "0.1.0"
