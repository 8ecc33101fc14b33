"""Which processes make up each shard: selectors, the process table and pods
(selectors, pods, kubelet, container_ids), counting them from /proc
(proc_shards), and the engines' own metrics (engine_metrics, over
http_fetch)."""
