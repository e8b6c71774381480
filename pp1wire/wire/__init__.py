"""The wire: messages, framing, fencing, the handshake and the two sans-IO protocol cores
(bytes and a clock in, events and bytes out; ``docs/protocol.md`` is normative)."""
