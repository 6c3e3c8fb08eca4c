"""Many replicas behind one endpoint (issue 26): the routing policies (``routing``) fed by the
replicas' KV-cache events; the Ray Serve deployment comes next (docs/cluster.md)."""
