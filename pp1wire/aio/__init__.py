"""The asyncio shells: the worker's server and the Spark side's client.

Each pumps bytes between sockets and a sans-IO core from :mod:`pp1wire.wire`
and owns the timers; neither holds protocol rules of its own.
"""
