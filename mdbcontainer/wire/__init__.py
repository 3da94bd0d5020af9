"""The wire: the one seam over kombu (connections, publish, subscription, delivery, heartbeats)."""
