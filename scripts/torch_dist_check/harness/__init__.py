"""The harness: how the ranks of a run are found or started (launch), meet (rendezvous), get their GPUs
(placement) and backends (backends), show their stages (progress), and run the checks in step (run)."""
