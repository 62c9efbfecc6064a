"""Time series of the cache counters: a sampler records ``cluster_stats()`` every interval (bounded
retention) and the selector turns consecutive samples into per-interval deltas for the charts."""
