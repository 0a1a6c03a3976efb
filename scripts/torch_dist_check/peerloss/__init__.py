"""The peer-loss lab (``--checks peerloss``): its cases and their launcher (cases), the worker processes they
start (worker, train_worker, hsdp_worker, with hsdp launching the HSDP case), and the judges of their outcomes."""
