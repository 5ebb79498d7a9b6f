"""The control plane in the gateway: API keys (service + in-memory cache), the
principal a request acts as, and the lifecycle of the SQL-backed parts."""
