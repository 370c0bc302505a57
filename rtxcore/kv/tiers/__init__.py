"""Lower KV-cache tiers under the device's prefix cache: host memory (``host.HostTier``) and disk (``disk.DiskTier``),
the copies between them and the device (``offload``), warm-restart snapshots (``snapshot``), and the stack an engine
builds from its config (``stack.KVTiers``)."""
