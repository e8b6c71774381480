"""The wire: messages, framing, fencing, the handshake and the two sans-IO protocol cores.

No asyncio and no sockets here: the cores take bytes and a clock in and hand
events and bytes out (``docs/protocol.md`` is the normative description).
"""
