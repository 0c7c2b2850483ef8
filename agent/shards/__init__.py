"""Pipeline shards: one supervisor process over N worker processes, each a whole pipeline for some cameras.

- placement: which camera runs in which shard (by load, kept across reloads) and how many shards `auto` is;
- protocol: the messages between the supervisor and a shard (one duplex pipe each);
- child: a shard process (the daemon's Agent in shard mode over its cameras);
- host: the supervisor's side of one shard (start, watch, restart with backoff);
- sharded: the supervisor (MQTT status and commands, engine builds, READY/WATCHDOG, telemetry).
"""
