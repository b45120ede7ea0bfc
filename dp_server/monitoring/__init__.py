"""What dp tells operators: structured logs, Prometheus metrics and probes.

The runtime imports this package, never the other way round: the status
endpoint reads the server through `dp_server.monitoring.view.ServerView`.
"""
