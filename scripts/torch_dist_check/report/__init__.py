"""What a run reports: the results and the JSON document (results), the tables of the GPU runs'
documents (tables, ``python -m torch_dist_check.tables``) and the optional plots (plot)."""
