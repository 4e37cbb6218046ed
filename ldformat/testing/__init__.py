"""Test suites and helpers shipped with ldformat, for its own tests and for new backends.

* :mod:`ldformat.testing.store_contract`: :class:`~ldformat.testing.store_contract.StoreContract`,
  the executable contract of :class:`ldformat.stores.Store` (spec §7.4, §21.2); subclass it
  once per backend. Importing it needs ``pytest``.

Fault injection lives with the stores: :class:`ldformat.stores.FaultyStore`.
"""
