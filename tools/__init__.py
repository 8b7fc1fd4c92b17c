"""The QA harness (run as ``python -m tools.NAME``): the GPU check, planted bugs, the results index."""
