"""The harness: how the ranks of a run are found or started (launch; forkserver, forkchild), import torch
(startup), meet (rendezvous), get their GPUs (placement) and backends (backends), show their stages
(progress), and run the checks in step (run)."""
