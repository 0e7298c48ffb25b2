"""Ways to run a captioning job beyond one process: a Ray cluster."""
