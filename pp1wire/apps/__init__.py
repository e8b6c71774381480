"""The applications: ``pp1-worker``, ``pp1-spark`` and ``pp1-demo``, their settings,
metrics and the built-in toy models.

Nothing in the library (:mod:`pp1wire.q`, :mod:`pp1wire.wire`,
:mod:`pp1wire.aio`) imports from here.
"""
