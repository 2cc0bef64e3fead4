"""One module per pipeline stage: plain functions on artifact paths (no Prefect imports).

Each stage reads its inputs from the run directory, writes its outputs atomically and returns a small summary
dict whose `wall_s` is the stage's own wall-clock measurement.
"""
