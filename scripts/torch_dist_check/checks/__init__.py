"""The checks every run makes: the environment (envinfo), the collectives' results (correctness, over
collectives), their speed (bandwidth), and a dead peer survived (fault, with its worker process fault_worker)."""
