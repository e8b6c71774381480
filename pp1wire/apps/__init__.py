"""The applications: ``pp1-worker``, ``pp1-spark`` and ``pp1-demo``, their settings, metrics and
the built-in models; nothing in the library imports from here."""
