"""The engine client: the core's sockets as one frontend holds them, and what it decides with
them (admission, tenants, replicas)."""
