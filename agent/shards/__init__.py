"""Pipeline shards: one supervisor process over N worker processes, each a whole pipeline for some cameras.

- placement: which camera runs in which shard (by load, kept across reloads) and how many shards `auto` is;
- protocol: the messages between the supervisor and a shard (one duplex pipe each);
- child: a shard process (a LocalRuntime over its cameras, its outlet the pipe: link);
- tracks: what a shard left open, closed by the supervisor when it dies;
- host: the supervisor's side of one shard (start, watch, restart with backoff);
- sharded: ShardedRuntime, the runtime of a device with shards (engine builds, the shards' reports).
"""
