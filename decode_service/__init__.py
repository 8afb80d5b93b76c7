"""Decode instance: reserves KV blocks under leases, receives pushed KV, streams tokens."""
