"""Ordered streams on a node: StreamService over the node's queues and the coordinator's stream records."""
