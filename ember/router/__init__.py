"""`ember route`: a gateway over replicas (session affinity, prefix-aware, health, failover)."""
