"""What every worker role shares: the engine core of a worker, the gRPC service, metrics, the agg role.

The role packages (prefill_worker/, decode_worker/) build on this one and never import each other.
"""
