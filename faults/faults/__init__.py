"""Fault-injection harness for idempotency-service (issue 14): a workload with a
history, a checker, and one module per fault in faults/scenarios/."""
