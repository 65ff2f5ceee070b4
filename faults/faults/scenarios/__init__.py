"""One module per scenario, each exporting SCENARIO (see faults/scenario.py
and faults/README.md). The runner finds every module here."""
