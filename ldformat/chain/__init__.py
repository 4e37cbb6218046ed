"""Ordinary chains: the commit log and its lock, the writer, the reader, and their maintenance.

Commit records and the fold (spec §7), the writer lock (§15), truncation and compaction
(§16, §17), validation (§18) and replication (§17.5). Sharded chains build on these modules
(:mod:`ldformat.sharded`); these modules only refuse them (:mod:`.sharded_probe`).
"""
