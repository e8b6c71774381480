"""The Spark side as a tensor-parallel group (``docs/tp.md``).

:mod:`pp1wire.tp.fanout` (numpy) is what rank 0 publishes each attempt;
:mod:`pp1wire.tp.group` (needs the ``tp`` extra: torch) runs the collectives.
"""
