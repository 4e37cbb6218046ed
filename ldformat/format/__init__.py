"""The format: what the objects of a chain contain and mean, without a store's commit protocol.

JSON values and checksums (spec §6), root metadata and commit records (§5, §7.1-§7.3),
stored state (§8), anchors (§9), deltas (§10) and replay (§11). Nothing here reads a log or
takes a lock; :mod:`ldformat.chain` does.
"""
